"""The recipe's ``drafter:`` section for a Kangaroo self-draft adapter."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from draftsmith.registry import register_config
from draftsmith.schema import DecoderShape, KindConfig, LayerTraits


@register_config
class KangarooConfig(KindConfig):
    kind: Literal["kangaroo"]
    exit_layer: int = Field(2, ge=1, description="l: the adapter reads the output of the target's decoder layer l "
                            "(1 <= l < L; checked against the target's L when the drafter is built)")
    adapter_mlp: bool = Field(False, description="add a SwiGLU MLP to the adapter (the public adapter has none)")
    threshold: float = Field(0.6, gt=0, lt=1, description="second early exit: stop drafting when the next "
                             "draft's top-1 probability is below this (Kangaroo's README: 0.6)")
    max_draft_len: int = Field(6, ge=1, le=32, description="gamma: at most this many drafts per step")
    vocab_keep: Optional[Union[int, float]] = Field(
        None, gt=0, description="draft over the N most frequent assistant-token ids of the training data (an int "
        "N, or a float ratio of the vocabulary), trained against the target renormalised over them (lossless)")


class KangarooModelConfig(KangarooConfig, DecoderShape, LayerTraits):
    """config.json of a Kangaroo adapter and `KangarooAdapter`'s one config argument: the recipe's fields, the
    target's sizes, its layer count, and the shape and traits (biases, q/k norms) of the layer the adapter
    copies."""
