"""The base of every typed config: unknown keys are errors, assignments are validated.

The recipe schema (`draftsmith.recipe`) and each kind's own config section build on these. A drafter kind's
fields are written once, in its recipe section (a `KindConfig` subclass); its checkpoint's config.json is that
section plus the target's shapes the module was built for (the subclass that also derives from `TargetShape`),
and that one object is the module's constructor argument.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """A config section: unknown keys are rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KindConfig(StrictModel):
    """The recipe's ``drafter:`` section of one drafter kind.

    A kind's subclass sets ``kind: Literal["NAME"]`` (the discriminator of the recipe's union of kinds)
    and its own fields, each with its help text.
    """

    kind: str

    def with_target(self, target) -> "KindConfig":
        """This section with its target-derived defaults filled in for ``target`` (a field left null in the recipe
        that depends on the target, e.g. EAGLE-3's aux layers): the section itself when it has none."""
        return self


class TargetShape(StrictModel):
    """The target's sizes a drafter module is built for: set from the target (`KindBase.for_target`), written to
    its config.json, and checked against the target a checkpoint is loaded for (`check_shape`)."""

    hidden_size: int = Field(ge=1, description="the target's hidden size (from the target, not the recipe)")
    vocab_size: int = Field(ge=1, description="the target's vocabulary size (from the target, not the recipe)")

    def check_shape(self, target, what: str) -> None:
        """ValueError naming the sizes when ``target`` is not the shape this config was built for."""
        if (self.hidden_size, self.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(f"{what} config is for hidden size {self.hidden_size} and vocabulary {self.vocab_size}; "
                             f"the target has {target.hidden_size} and {target.vocab_size}")


#: the Hugging Face layer types whose attention `LayerTraits` reads (Llama's layer, with these differences)
KNOWN_LAYERS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


class LayerTraits(StrictModel):
    """How the target's decoder layer differs from Llama's, for a drafter layer built like it and initialised from
    it (Hydra++'s prefix layer, Kangaroo's adapter): read from the target's config, never assumed. The defaults
    are Llama's, so configs written before these fields load as they were."""

    qkv_bias: bool = Field(False, description="q, k and v projections with biases (Qwen2)")
    o_bias: bool = Field(False, description="the output projection with a bias")
    qk_norm: bool = Field(False, description="RMS norms on each head's queries and keys before RoPE (Qwen3, Gemma 3)")
    norm_offset: bool = Field(False, description="RMS norms scale by 1 + weight, weights stored as offsets (Gemma)")
    sandwich_norms: bool = Field(False, description="norms on the attention's and the MLP's outputs too, before "
                                 "each residual (Gemma 3)")
    query_scale: Optional[float] = Field(None, gt=0, description="attention scores scaled by this, not by "
                                         "head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)")
    activation: Literal["silu", "gelu_tanh"] = Field("silu", description="the MLP's gate activation (Gemma: GELU, "
                                                     "tanh-approximated)")

    @staticmethod
    def traits(target) -> dict:
        """These fields for ``target`` (Llama's defaults left out); a layer type not in `KNOWN_LAYERS`, or a
        feature of a known one the drafter layer does not model, is a ValueError naming it."""
        c = target.model.config
        mt = str(getattr(c, "model_type", ""))
        if mt not in KNOWN_LAYERS:
            raise ValueError(f"the target's decoder layer is {mt!r}; a drafter layer built like the target's knows "
                             f"{', '.join(KNOWN_LAYERS)} (EAGLE-3 and the head kinds do not need it)")
        if getattr(c, "mlp_bias", False):
            raise ValueError(f"the target's {mt} layer has MLP biases, which the drafter layer does not model")
        bias = bool(getattr(c, "attention_bias", False))
        if mt == "gemma3_text":
            if getattr(c, "attn_logit_softcapping", None):
                raise ValueError("the target's gemma3_text layer caps its attention logits (attn_logit_softcapping),"
                                 " which the drafter layer does not model")
            act = str(getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", ""))
            if act not in _GELU_TANH:
                raise ValueError(f"the target's gemma3_text layer's activation is {act!r}; the drafter layer knows "
                                 f"{', '.join(_GELU_TANH)} for Gemma")
            return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "norm_offset": True, "sandwich_norms": True,
                    "query_scale": float(c.query_pre_attn_scalar) ** -0.5, "activation": "gelu_tanh"}
        act = str(getattr(c, "hidden_act", "silu"))
        if act != "silu":
            raise ValueError(f"the target's {mt} layer's activation is {act!r}; the drafter layer knows silu for it")
        if mt == "qwen2":  # q/k/v always biased, o never (its attention ignores attention_bias)
            return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": mt == "qwen3"}

    def layer_traits(self) -> dict:
        """These fields as `draftsmith.common.layers.DecoderLayer`'s keyword arguments."""
        return {name: getattr(self, name) for name in LayerTraits.model_fields}


#: Hugging Face's names of the tanh-approximated GELU
_GELU_TANH = ("gelu_pytorch_tanh",)


class DecoderShape(TargetShape):
    """The target's sizes and one decoder layer's shape, for a drafter that runs a layer of the target's shape
    (EAGLE-3's, Kangaroo's adapter) and checks its layer ids against the target's count."""

    num_layers: int = Field(ge=1, description="the target's decoder layers")
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    eps: float = 1e-6

    @staticmethod
    def of(target) -> dict:
        """These fields read off ``target`` (its Hugging Face config)."""
        c = target.model.config
        nh = int(c.num_attention_heads)
        return {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
                "num_layers": int(c.num_hidden_layers), "num_heads": nh,
                "num_kv_heads": int(getattr(c, "num_key_value_heads", None) or nh),
                "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // nh),
                "intermediate_size": int(c.intermediate_size), "eps": float(getattr(c, "rms_norm_eps", 1e-6))}

    def check_layers(self, target, what: str) -> None:
        """`check_shape`, and the target's layer count."""
        self.check_shape(target, what)
        n = int(target.model.config.num_hidden_layers)
        if self.num_layers != n:
            raise ValueError(f"{what} drafter was trained on a target with {self.num_layers} layers, this one has {n}")
