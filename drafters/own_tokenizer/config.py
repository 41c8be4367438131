"""The recipe's ``drafter:`` section for a drafter with its own tokenizer."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from draftsmith.registry import register_config
from draftsmith.schema import KindConfig


@register_config
class OwnTokenizerConfig(KindConfig):
    kind: Literal["own-tokenizer"]
    tokenizer_vocab_size: int = Field(8192, ge=300, description="byte-level BPE trained on the self-distilled text "
                                      "(the target's special tokens included)")
    tokenizer_min_frequency: int = Field(2, ge=1, description="BPE: a merge needs this many occurrences")
    init: Literal["target", "scratch"] = Field(
        "target", description="target: the target's first num_hidden_layers layers and its sizes, embedding rows "
        "from the target's (shared strings) or the mean of its pieces; scratch: random, sizes below")
    num_hidden_layers: int = Field(2, ge=1)
    hidden_size: Optional[int] = Field(None, ge=8, description="scratch only (default: the target's)")
    intermediate_size: Optional[int] = Field(None, ge=8, description="scratch only (default: the target's)")
    num_attention_heads: Optional[int] = Field(None, ge=1, description="scratch only (default: the target's)")
    num_key_value_heads: Optional[int] = Field(None, ge=1, description="scratch only (default: the target's)")

    @model_validator(mode="after")
    def _sizes(self):
        set_ = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
                if getattr(self, k) is not None]
        if self.init == "target" and set_:
            raise ValueError(f"{set_} come from the target with init: target; use init: scratch to choose them")
        return self


class OwnTokenizerModelConfig(OwnTokenizerConfig):
    """config.json of an own-tokenizer drafter and `OwnTokenizerDrafter`'s config argument: the recipe's fields,
    and its tokenizer's size and sha256 (set from the tokenizer it is built with)."""

    vocab_size: Optional[int] = Field(None, ge=1, description="the drafter's own vocabulary (from its tokenizer)")
    tokenizer_sha256: Optional[str] = Field(None, description="its tokenizer.json's digest (checked on load)")
