"""The recipe's ``drafter:`` section for a DFlash drafter."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator

from draftsmith.registry import register_config
from draftsmith.schema import DecoderShape, KindConfig


@register_config
class DFlashConfig(KindConfig):
    kind: Literal["dflash"]
    target_layers: Optional[list[int]] = Field(
        None, description="the target states fused into the context, as Hugging Face `hidden_states` indices (N = "
        "output of decoder layer N, 1-based; vLLM's and llama.cpp's ids, z-lab's ids + 1); null (the default): "
        "z-lab's rule, 5 ids spread from layer 2 to L-2 for the target's L layers ([2, 9, 15, 21, 28] on the "
        "30-layer default target)")
    draft_layers: int = Field(1, ge=1, le=8, description="the drafter's decoder layers (z-lab's recipes: 5 on GPUs; "
                            "one keeps the draft pass small next to a 135M target's step on a CPU)")
    block_size: int = Field(8, ge=2, le=32, description="tokens in a block: the newest token, then block_size - 1 "
                            "mask tokens, each drafted in the one forward")
    mask_token_id: Optional[int] = Field(
        None, ge=0, description="the token whose (frozen, shared) embedding fills the block's mask slots; null: the "
        "tokenizer's mask token, else a spare embedding row past the tokenizer, else pad, eos, unk (the reference "
        "trainers' order). It should never occur in the data")
    gamma: Optional[float] = Field(4.0, gt=0, description="slot k's loss weight is exp(-(k-1)/gamma) (null: equal "
                                   "weights)")
    max_anchors: int = Field(512, ge=1, description="blocks trained per sequence: anchors drawn at random, without "
                             "replacement, among its assistant tokens")
    vocab_keep: Optional[Union[int, float]] = Field(
        8192, gt=0, description="draft vocabulary: the N most frequent assistant-token ids of the training data "
        "(an int N, or a float ratio of the vocabulary); exported as d2t / t2d; null = the full vocabulary")
    draft_len: Optional[int] = Field(None, ge=1, le=31, description="default chain length when decoding (null: "
                                     "block_size - 1, every slot of the block)")

    @field_validator("target_layers")
    @classmethod
    def _increasing(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(i < 1 for i in v) or sorted(set(v)) != v):
            raise ValueError(f"target_layers must be increasing layer indices >= 1, got {v}")
        return v

    def with_target(self, target) -> "DFlashConfig":
        if self.target_layers is not None:
            return self
        layers = default_target_layers(int(target.model.config.num_hidden_layers))
        return self.model_copy(update={"target_layers": layers})


def default_target_layers(num_layers: int, count: int = 5) -> list[int]:
    """z-lab's and SpecForge's rule (`build_target_layer_ids`: ``count`` ids spread evenly from layer 1 to L-3, as
    0-based outputs), as Hugging Face `hidden_states` indices (+1): [2, 9, 15, 21, 28] for 30 layers; fewer ids
    on a target too shallow for ``count`` distinct ones."""
    if num_layers < 2:
        raise ValueError(f"DFlash reads the target's intermediate layers: a target of {num_layers} layer has none")
    lo, hi = 1, max(1, num_layers - 3)
    ids = sorted({int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count)}) if hi > lo else [lo]
    return [i + 1 for i in ids if i + 1 < num_layers] or [1]


class DFlashModelConfig(DFlashConfig, DecoderShape):
    """config.json of a DFlash drafter and `DFlashModule`'s one config argument: the recipe's fields (the mask id
    resolved), the target's sizes and layer count, and the shape of the target's layer its layers copy."""
