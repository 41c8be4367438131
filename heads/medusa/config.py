"""The recipe's ``drafter:`` section for Medusa heads."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from draftsmith.registry import register_config
from draftsmith.schema import KindConfig, TargetShape


@register_config
class MedusaConfig(KindConfig):
    kind: Literal["medusa"]
    num_heads: int = Field(4, ge=1, le=16)
    num_layers: int = Field(1, ge=0, le=8, description="ResBlocks per head")
    share_lm_head: bool = Field(True, description="project through the target's frozen LM head (else a trainable copy)")
    vocab_keep: Optional[Union[int, float]] = Field(
        None, gt=0, description="draft over the N most frequent assistant-token ids of the training data (an int "
        "N, or a float ratio of the vocabulary); training and drafting get N/V times cheaper (lossless)")


class MedusaModelConfig(MedusaConfig, TargetShape):
    """config.json of Medusa heads and `MedusaHeads`' one config argument: the recipe's fields and the target's
    sizes."""
