"""The recipe's ``drafter:`` section for an EAGLE-3 drafter."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator

from draftsmith.registry import register_config
from draftsmith.schema import DecoderShape, KindConfig


@register_config
class Eagle3Config(KindConfig):
    kind: Literal["eagle3"]
    aux_layers: Optional[list[int]] = Field(
        None, description="the three target states fused (low, middle, high), as Hugging Face `hidden_states` "
        "indices (N = output of decoder layer N, 1-based; vLLM's `eagle_aux_hidden_state_layer_ids`); null (the "
        "default): [2, L/2, L-3] for the target's L layers, [2, 15, 27] on the 30-layer default target")
    vocab_keep: Optional[Union[int, float]] = Field(
        8192, gt=0, description="draft vocabulary: the N most frequent assistant-token ids of the training data "
        "(an int N, or a float ratio of the vocabulary); exported as d2t / t2d; null = the full vocabulary")
    ttt_steps: int = Field(7, ge=1, le=16, description="training-time test: steps unrolled, each fed its own "
                           "previous output state")
    step_decay: float = Field(0.8, gt=0, le=1, description="step k's loss weight is step_decay**k")
    train_head: bool = Field(False, description="train the draft LM head (initialised from the target's kept "
                             "rows) instead of keeping it frozen")
    draft_len: int = Field(4, ge=1, le=32, description="default chain length when decoding")
    # EAGLE 3.1 (vLLM's and speculators' names; all off = EAGLE-3 as published)
    norm_before_fc: bool = Field(False, description="one RMSNorm over the concatenated target states before fc "
                                 "(vLLM's and llama.cpp's norm_before_fc)")
    fc_norm: bool = Field(False, description="EAGLE 3.1: an RMSNorm on each of the three target states before fc "
                          "(vLLM's fc_norm)")
    norm_output: bool = Field(False, description="EAGLE 3.1: each step feeds the next its post-norm output state, "
                              "not the pre-norm one (vLLM's norm_output)")

    @field_validator("aux_layers")
    @classmethod
    def _three(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 3 or any(i < 1 for i in v) or sorted(v) != v or len(set(v)) != 3):
            raise ValueError(f"aux_layers must be three increasing layer indices >= 1 (low, middle, high), got {v}")
        return v

    def with_target(self, target) -> "Eagle3Config":
        if self.aux_layers is not None:
            return self
        return self.model_copy(update={"aux_layers": default_aux_layers(int(target.model.config.num_hidden_layers))})


def default_aux_layers(num_layers: int) -> list[int]:
    """The usual aux layers of a target with ``num_layers`` decoder layers: [2, L/2, L-3] (EAGLE-3's reference
    code and vLLM's default), [1, L/2, L-1] where that does not give three increasing ids (L < 8)."""
    for aux in ([2, num_layers // 2, num_layers - 3], [1, num_layers // 2, num_layers - 1]):
        if len(set(aux)) == 3 and sorted(aux) == aux and aux[0] >= 1 and aux[-1] < num_layers:
            return aux
    raise ValueError(f"EAGLE-3 fuses three of the target's layer outputs: a target of {num_layers} layers has too "
                     "few (it needs 4)")


class Eagle3ModelConfig(Eagle3Config, DecoderShape):
    """config.json of an EAGLE-3 drafter and `Eagle3Module`'s one config argument: the recipe's fields, the
    target's sizes, its layer count and the shape of the one decoder layer it runs."""
