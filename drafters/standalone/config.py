"""The recipe's ``drafter:`` section for a standalone distilled drafter."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from draftsmith.registry import register_config
from draftsmith.schema import KindConfig, StrictModel


class LoraSettings(StrictModel):
    rank: int = Field(8, ge=1, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA scale alpha (the update is alpha / r * B A)")
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], description="module names given adapters")


@register_config
class StandaloneConfig(KindConfig):
    kind: Literal["standalone"]
    init: str = Field("target", description="target: the target's first num_layers layers, embeddings and head; "
                      "scratch: a fresh Llama of the sizes below; or a local HF model directory with the target's "
                      "tokenizer (checked)")
    num_layers: int = Field(2, ge=1, description="decoder layers (init: target or scratch)")
    hidden_size: Optional[int] = Field(None, ge=8, description="init: scratch only (default: the target's)")
    num_heads: Optional[int] = Field(None, ge=1, description="init: scratch only (default: the target's)")
    num_kv_heads: Optional[int] = Field(None, ge=1, description="init: scratch only (default: the target's)")
    intermediate_size: Optional[int] = Field(None, ge=8, description="init: scratch only (default: the target's)")
    divergence: Literal["fkl", "rkl", "tvd", "jsd"] = Field(
        "fkl", description="fkl: KL(p||q); rkl: KL(q||p); tvd: total variation; jsd: DistillSpec's JSD[beta]")
    jsd_beta: float = Field(0.5, gt=0, lt=1,
                            description="jsd: beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q")
    train_embeddings: Optional[bool] = Field(None, description="also train the embeddings and output head "
                                             "(default: only for init: scratch)")
    lora: Optional[LoraSettings] = Field(None, description="train peft LoRA adapters instead of the layers' weights "
                                         "(merged into the checkpoint)")
    vocab_keep: Optional[Union[int, float]] = Field(
        None, gt=0, description="draft over the N most frequent assistant-token ids of the training data (an int "
        "N, or a float ratio of the vocabulary), trained against the target renormalised over them (lossless)")
    rdk: bool = Field(False, description="with vocab_keep: build the sparse RDK affinity map (docs/rdk.md) and "
                      "draft from q_RDK = M^T q' (lossless)")
    rdk_positions: int = Field(20000, ge=1, description="training positions the RDK map is estimated from")
    rdk_topk: int = Field(16, ge=1, description="RDK: pairs among the top-k kept and top-k pruned ids per position")
    draft_len: int = Field(4, ge=1, le=32, description="default chain length when decoding")


class StandaloneModelConfig(StandaloneConfig):
    """config.json of a standalone drafter and `StandaloneDrafter`'s config argument: the recipe's fields and
    ``model``, the Hugging Face config of the network itself (the authority on its sizes: the recipe's sizes say
    only how it was built)."""

    model: dict = Field(default_factory=dict, description="the drafter network's Hugging Face config (set when "
                        "the network is built)")
