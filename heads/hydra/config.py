"""The recipe's ``drafter:`` section for Hydra and Hydra++ heads."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from draftsmith.registry import register_config
from draftsmith.schema import KindConfig, LayerTraits, TargetShape


@register_config
class HydraConfig(KindConfig):
    kind: Literal["hydra"]
    num_heads: int = Field(4, ge=1, le=16)
    num_layers: int = Field(1, ge=1, le=8, description="layers per head (input layer included); Hydra++: 4")
    dropout: float = Field(0.0, ge=0, lt=1, description="Hydra++: 0.2")
    prefix_layer: bool = Field(False, description="Hydra++: one decoder layer over the base hidden states")
    vocab_keep: Optional[Union[int, float]] = Field(
        None, gt=0, description="draft over the N most frequent assistant-token ids of the training data (an int "
        "N, or a float ratio of the vocabulary); training and drafting get N/V times cheaper (lossless)")


class PrefixShape(LayerTraits):
    """Hydra++'s prefix layer: the target's attention and MLP sizes and its layer's traits (biases, q/k norms),
    from its config."""

    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    rope_theta: float = 10000.0
    eps: float = 1e-6


class HydraModelConfig(HydraConfig, TargetShape):
    """config.json of Hydra/Hydra++ heads and `HydraHeads`' one config argument: the recipe's fields, the
    target's sizes and, with ``prefix_layer``, the prefix layer's shape."""

    prefix: Optional[PrefixShape] = Field(None, description="the prefix layer's shape (with prefix_layer)")
