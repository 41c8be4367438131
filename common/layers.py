"""The one decoder layer the kinds run (Hydra++'s prefix layer, EAGLE-3's layer, Kangaroo's adapter), eagerly and
in their compiled drafting, and its pieces.

`DecoderLayer` is a pre-norm layer of the target's attention shape: RMS-normed input, q/k/v projections with RoPE,
grouped-query attention, the output projection and the residual, then (optionally) an RMS-normed SwiGLU MLP and its
residual. It is split in the phases every caller shares, because the kinds attend differently (a cache they
concatenate, a pre-allocated buffer with a mask, EAGLE-3's training-time test over diagonal keys):

  * `attention_input` (the input norm; EAGLE-3's layer reads two inputs, each normed, concatenated),
  * `qkv` (projections and RoPE at given positions), `expand` (grouped-query heads), `attend` (SDPA),
  * `finish` (output projection, residual, MLP).

Where the target's layer differs from Llama's (`draftsmith.schema.LayerTraits`: Qwen's biases and q/k norms, Gemma 3's
norms scaling by 1 + weight, its norms on the attention's and MLP's outputs, its score scale and its GELU), the
layer is built like it. Its parameter names are the kinds' checkpoint names: ``input_norm`` (and ``hidden_norm``),
``q``, ``k``, ``v``, ``o``, ``post_norm``, ``gate``, ``up``, ``down`` (and ``q_norm``, ``k_norm``,
``attn_out_norm``, ``mlp_out_norm``). Checkpoints written with a kind's earlier names load through
`rename_on_load`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back to the input's dtype, then scaled (Llama's). With ``offset`` the scale
    is 1 + weight, applied in fp32 before the cast, and the weight starts at zero (Gemma's)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.offset = bool(offset)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (n * (1.0 + self.weight.float())).to(x.dtype)
        return n.to(x.dtype) * self.weight


#: the MLP activations a decoder layer knows, by `LayerTraits.activation`: Llama's SiLU, Gemma's tanh-approximated
#: GELU (Hugging Face's gelu_pytorch_tanh)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of the last dimension's two halves."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's inverse frequencies for ``head_dim`` and base ``theta`` (float32, [head_dim / 2])."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def target_rope(rotary: nn.Module) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of a target's rotary embedding module: its one RoPE (Llama, Qwen,
    Mistral; scaled variants such as Llama 3's included, as the module computed them), or, where each layer type
    has a RoPE of its own (Gemma 3: a local base for sliding layers, a global one for full layers), the full
    layers'. A drafter layer attends over the whole prefix, as those do."""
    inv = getattr(rotary, "inv_freq", None)
    if inv is None:
        inv = getattr(rotary, "full_attention_inv_freq", None)
    if inv is None:
        raise ValueError(f"the target's rotary embedding ({type(rotary).__name__}) has neither inv_freq nor "
                         "full_attention_inv_freq: draftsmith cannot read its RoPE")
    scale = getattr(rotary, "attention_scaling", 1.0)
    if isinstance(scale, dict):
        scale = scale.get("full_attention", 1.0)
    return inv, float(scale)


def layer_rope(body: nn.Module, x: torch.Tensor, pos: torch.Tensor, lo: int, hi: int) -> list:
    """The position embeddings (cos, sin) the target's decoder ``body`` gives each of its layers lo..hi-1 at
    positions ``pos``, for a caller that runs those layers one by one: the one RoPE, or the layer's type's where
    the rotary module has one per type (Gemma 3: a local base for sliding layers, a global one for full layers)."""
    rot, types = body.rotary_emb, getattr(body.config, "layer_types", None)
    if types and all(hasattr(rot, f"{t}_inv_freq") for t in set(types[lo:hi])):
        by_type = {t: rot(x, pos, layer_type=t) for t in set(types[lo:hi])}
        return [by_type[types[i]] for i in range(lo, hi)]
    return [rot(x, pos)] * (hi - lo)


def rope_parameters(config) -> dict:
    """The RoPE a drafter layer copies from the target (`target_rope`) as config fields: ``rope_theta`` and, when
    its type is not the default one, ``rope_scaling`` (the type and its factors), read from the target's config:
    ``rope_parameters`` (per layer type or not) or the older ``rope_theta`` and ``rope_scaling``."""
    rp = getattr(config, "rope_parameters", None) or {}
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        rp = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    out = {"rope_theta": float(rp["rope_theta"])}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        out["rope_scaling"] = {k: v for k, v in rp.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    return out


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer (see the module docstring).

    Args:
      hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps: the layer's shape.
      inputs: 1, or 2 for EAGLE-3's layer (token embedding and hidden state, each normed, concatenated: the
        projections read 2 x hidden_size).
      mlp: with the MLP and its norm (Kangaroo's adapter may leave them out).
      inv_freq, rope_scale: RoPE's inverse frequencies (copied into a buffer of the layer's own, not stored in
        checkpoints) and the attention scaling applied to cos and sin (a target's rotary module gives both).
      zero_outputs: start the output projections (``o`` and ``down``) at zero, so the layer starts as the identity
        (with sandwich norms: the output norms' scales at zero instead).
      qkv_bias, o_bias, qk_norm, norm_offset, sandwich_norms, query_scale, activation: the target layer's
        differences from Llama's (`draftsmith.schema.LayerTraits`): biases on q/k/v (Qwen2) or o, RMS norms
        ``q_norm``/``k_norm`` over each head's queries and keys before RoPE (Qwen3, Gemma 3); Gemma 3's norms that
        scale by 1 + weight, its norms on the attention's and the MLP's outputs (``attn_out_norm``,
        ``mlp_out_norm``; ``post_norm`` is then the MLP's input norm), its score scale and its tanh-GELU MLP.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float = 1e-6, *, inputs: int = 1, mlp: bool = True, inv_freq: torch.Tensor | None = None,
                 rope_scale: float = 1.0, zero_outputs: bool = False, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False, norm_offset: bool = False, sandwich_norms: bool = False,
                 query_scale: float | None = None, activation: str = "silu"):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if inputs not in (1, 2):
            raise ValueError(f"a decoder layer reads 1 or 2 inputs, got {inputs}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: the decoder layer knows {', '.join(ACTIVATIONS)}")
        self.nh, self.nkv, self.hd = num_heads, num_kv_heads, head_dim
        self.inputs, self.mlp = inputs, bool(mlp)
        self.scale = None if query_scale is None else float(query_scale)  # None: head_dim ** -0.5
        self.act = ACTIVATIONS[activation]
        self.sandwich = bool(sandwich_norms)

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, eps, offset=norm_offset)

        self.input_norm = norm(hidden_size)
        if inputs == 2:
            self.hidden_norm = norm(hidden_size)
        width = inputs * hidden_size
        self.q = nn.Linear(width, num_heads * head_dim, bias=qkv_bias)
        self.k = nn.Linear(width, num_kv_heads * head_dim, bias=qkv_bias)
        self.v = nn.Linear(width, num_kv_heads * head_dim, bias=qkv_bias)
        self.o = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = bool(qk_norm)
        if qk_norm:
            self.q_norm = norm(head_dim)
            self.k_norm = norm(head_dim)
        if self.sandwich:
            self.attn_out_norm = norm(hidden_size)
        if mlp:
            self.post_norm = norm(hidden_size)
            self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
            if self.sandwich:
                self.mlp_out_norm = norm(hidden_size)
        if zero_outputs and self.sandwich:
            # the output norms' scales at zero instead: a norm of a zero output would pass its first nonzero
            # update at full scale (its gradient at 0 is 1/sqrt(eps)), so the projections keep their random values
            # and each branch grows from zero through its scale, as a zero projection does without these norms
            for n in [self.attn_out_norm] + ([self.mlp_out_norm] if mlp else []):
                nn.init.constant_(n.weight, -1.0 if norm_offset else 0.0)
        elif zero_outputs:
            nn.init.zeros_(self.o.weight)
            if o_bias:
                nn.init.zeros_(self.o.bias)
            if mlp:
                nn.init.zeros_(self.down.weight)
        inv = rope_frequencies(head_dim, 10000.0) if inv_freq is None else inv_freq.detach().float().clone()
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = float(rope_scale)

    # ------------------------------------------------------------------ the phases
    def attention_input(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """The projections' input: ``input_norm(x)``, or for a 2-input layer ``[input_norm(x); hidden_norm(h)]``."""
        if self.inputs == 1:
            return self.input_norm(x)
        return torch.cat([self.input_norm(x), self.hidden_norm(h)], dim=-1)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [..., heads, T, hd] at positions pos [..., T]. The angles are computed in float32 whatever the layer's
        dtype (as the target's rotary embedding does): positions past 256 are not exact in bf16."""
        ang = pos.float()[..., None] * self.inv_freq.float()  # [..., T, hd/2]
        emb = torch.cat([ang, ang], dim=-1).unsqueeze(-3)  # [..., 1, T, hd]
        cos, sin = (emb.cos() * self.rope_scale).to(x.dtype), (emb.sin() * self.rope_scale).to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def qkv(self, a: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention input a [..., T, width] (`attention_input`) at positions pos [..., T] -> q [..., nh, T, hd]
        and k, v [..., nkv, T, hd], RoPE applied to q and k."""
        *lead, T, _ = a.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(*lead, T, n, self.hd).transpose(-2, -3)

        q, k = heads(self.q(a), self.nh), heads(self.k(a), self.nkv)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, pos), self.rope(k, pos), heads(self.v(a), self.nkv)

    def kv(self, a: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values only (`qkv` without the queries): a [..., T, width] at positions pos [..., T] -> k, v
        [..., nkv, T, hd], RoPE applied to k (DFlash projects the target's context this way)."""
        *lead, T, _ = a.shape
        k = self.k(a).view(*lead, T, self.nkv, self.hd).transpose(-2, -3)
        if self.qk_norm:
            k = self.k_norm(k)
        return self.rope(k, pos), self.v(a).view(*lead, T, self.nkv, self.hd).transpose(-2, -3)

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[..., nkv, S, hd] -> [..., nh, S, hd] (grouped-query attention)."""
        rep = self.nh // self.nkv
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=-3)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Scaled dot-product attention of q [..., nh, T, hd] over k, v [..., nkv, S, hd]; ``mask`` [T, S] (bool:
        True = may attend, or additive), None = every key."""
        return F.scaled_dot_product_attention(q, self.expand(k), self.expand(v), attn_mask=mask, scale=self.scale)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual h [..., T, H] plus the output projection of attn [..., nh, T, hd], then the MLP with its
        residual (each output normed first with sandwich norms)."""
        *lead, _, T, _ = attn.shape
        a = self.o(attn.transpose(-2, -3).reshape(*lead, T, self.nh * self.hd))
        x = h + (self.attn_out_norm(a) if self.sandwich else a)
        if not self.mlp:
            return x
        y = self.post_norm(x)
        m = self.down(self.act(self.gate(y)) * self.up(y))
        return x + (self.mlp_out_norm(m) if self.sandwich else m)

    # ------------------------------------------------------------------ construction
    def init_from(self, layer: nn.Module, mlp: bool = True, outputs: bool = False) -> None:
        """Copy a Hugging Face Llama-style decoder layer's weights (and biases) where their shapes match: the input
        norm, q, k, v (and the per-head q/k norms), and with ``mlp`` the MLP's norm, gate and up; with ``outputs``
        also o and down and the output norms of sandwich norms (else they keep their values: zero projections, or
        zero output-norm scales, for a layer that starts as the identity)."""
        pairs = [(self.input_norm, "input_layernorm"), (self.q, "self_attn.q_proj"), (self.k, "self_attn.k_proj"),
                 (self.v, "self_attn.v_proj")]
        if self.qk_norm:
            pairs += [(self.q_norm, "self_attn.q_norm"), (self.k_norm, "self_attn.k_norm")]
        if outputs:
            pairs.append((self.o, "self_attn.o_proj"))
            if self.sandwich:  # Gemma's names: the attention's output norm is its post_attention_layernorm
                pairs.append((self.attn_out_norm, "post_attention_layernorm"))
        if mlp and self.mlp:
            pairs += [(self.post_norm, "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"),
                      (self.gate, "mlp.gate_proj"), (self.up, "mlp.up_proj")]
            pairs += [(self.down, "mlp.down_proj")] if outputs else []
            pairs += [(self.mlp_out_norm, "post_feedforward_layernorm")] if self.sandwich and outputs else []
        with torch.no_grad():
            for mine, name in pairs:
                src = layer.get_submodule(name)
                if src.weight.shape == mine.weight.shape:
                    mine.weight.copy_(src.weight.float())
                    b, sb = getattr(mine, "bias", None), getattr(src, "bias", None)
                    if b is not None and sb is not None and b.shape == sb.shape:
                        b.copy_(sb.float())


class LayerKV:
    """One sequence's keys and values for a `DecoderLayer` a drafter runs beside the target (Hydra++'s prefix layer,
    EAGLE-3's layer), pre-allocated, [kv_heads, capacity + node_slots, head_dim] each: slots 0..capacity-1 hold the
    sequence's entries, written in place by the compiled drafting steps; the node slots after them (EAGLE-3) hold
    the current draft tree's. A copied decode state gets its own copy (``copy.copy`` forks it), so two branches never
    share a buffer. (The target's own cache, all layers and rows, is `draftsmith.engine.kvcache.KVCache`.)"""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int | None = None):
        self.keys, self.values = keys, values
        self.capacity = int(keys.shape[1]) if capacity is None else int(capacity)

    @classmethod
    def empty(cls, layer: DecoderLayer, capacity: int, nodes: int = 0, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> "LayerKV":
        """Zeroed buffers for ``layer``'s key/value heads: ``capacity`` sequence slots and ``nodes`` node slots."""
        shape = (layer.nkv, int(capacity) + int(nodes), layer.hd)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   capacity)

    @property
    def node_slots(self) -> int:
        return int(self.keys.shape[1]) - self.capacity

    def grown(self, nodes: int) -> "LayerKV":
        """A copy with ``nodes`` node slots (at least as many as now)."""
        nkv, S, hd = self.keys.shape
        keys = self.keys.new_zeros(nkv, self.capacity + nodes, hd)
        values = self.values.new_zeros(nkv, self.capacity + nodes, hd)
        keys[:, :S].copy_(self.keys)
        values[:, :S].copy_(self.values)
        return LayerKV(keys, values, self.capacity)

    def __copy__(self) -> "LayerKV":
        return LayerKV(self.keys.clone(), self.values.clone(), self.capacity)


def rename_on_load(module: nn.Module, renames: dict[str, str]) -> None:
    """Let ``module`` load state dicts written with earlier parameter names: each key starting with an old prefix
    (relative to ``module``) is renamed to its new prefix before loading. Keys already in the new names pass."""

    def hook(state_dict, prefix, *_):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rel = key[len(prefix):]
            for old, new in renames.items():
                if rel.startswith(old):
                    state_dict[prefix + new + rel[len(old):]] = state_dict.pop(key)
                    break

    module._register_load_state_dict_pre_hook(hook)
