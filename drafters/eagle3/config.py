"""The recipe's ``drafter:`` section for an EAGLE-3 drafter."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator

from draftsmith.registry import register_config
from draftsmith.schema import DecoderShape, KindConfig


@register_config
class Eagle3Config(KindConfig):
    kind: Literal["eagle3"]
    aux_layers: list[int] = Field(
        [2, 15, 27], description="the three target states fused (low, middle, high), as Hugging Face "
        "`hidden_states` indices (N = output of decoder layer N, 1-based); the convention [2, N/2, N-3] gives "
        "[2, 15, 27] for the 30-layer default target (vLLM's `eagle_aux_hidden_state_layer_ids`)")
    vocab_keep: Optional[Union[int, float]] = Field(
        8192, gt=0, description="draft vocabulary: the N most frequent assistant-token ids of the training data "
        "(an int N, or a float ratio of the vocabulary); exported as d2t / t2d; null = the full vocabulary")
    ttt_steps: int = Field(7, ge=1, le=16, description="training-time test: steps unrolled, each fed its own "
                           "previous output state")
    step_decay: float = Field(0.8, gt=0, le=1, description="step k's loss weight is step_decay**k")
    train_head: bool = Field(False, description="train the draft LM head (initialised from the target's kept "
                             "rows) instead of keeping it frozen")
    draft_len: int = Field(4, ge=1, le=32, description="default chain length when decoding")

    @field_validator("aux_layers")
    @classmethod
    def _three(cls, v: list[int]) -> list[int]:
        if len(v) != 3 or any(i < 1 for i in v) or sorted(v) != v or len(set(v)) != 3:
            raise ValueError(f"aux_layers must be three increasing layer indices >= 1 (low, middle, high), got {v}")
        return v


class Eagle3ModelConfig(Eagle3Config, DecoderShape):
    """config.json of an EAGLE-3 drafter and `Eagle3Module`'s one config argument: the recipe's fields, the
    target's sizes, its layer count and the shape of the one decoder layer it runs."""
