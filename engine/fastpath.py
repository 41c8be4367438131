"""A static-shape decoding forward for Llama-family targets, compiled with inductor on CPU (gpt-fast style).

The decoder calls the target's body through its public forward (``body(input_ids=..., position_ids=...,
attention_mask=..., cache=KVCache)``). `FastBody` is a drop-in for that call: the same arguments, the
same pre-allocated `KVCache`, the same result (``.last_hidden_state``, after the final norm), plus
``.logits`` from the LM head inside the same graph. What it changes is how the work is done:

  * the weights are fused (q/k/v in one matrix, gate/up in one). float32 steps of up to 16 rows (and bf16
    steps and prefills on a CPU without bf16 instructions, bf16 steps of up to 16 rows on one with AVX512_BF16
    and no AMX) multiply by the native kernel
    (`draftsmith.engine.native.decode_linear`), which reads each weight once at close to the memory's
    bandwidth; other steps and dtypes, compiled, have the weights frozen into the graph: inductor packs each
    weight once for oneDNN (bf16), MKL (fp32) or its CPP GEMM template where autotuning finds that faster
    (docs/methods.md §17);
  * a 1-row step that sees every slot so far attends by the native decode kernel over its live slots, in a
    graph whose kernels inductor's C++ wrapper calls (`FastBody`'s ``cpp_wrapper``);
  * the rows of one call are padded up to a bucket (1, 4, 8, 16, 32) that a decoder reserved (its 1-row
    step and its largest step): one compiled graph per bucket, so plain decoding, a chain or a static tree
    compile at most two, and a step cut short near the end of a generation reuses the larger one. A padded
    row writes its key and value past the committed entries, where the next forward overwrites them (as a
    rejected draft's entries are), and attends to nothing but itself, so it changes no real row. A chain or
    tree block that the native block kernel attends runs the one block graph, whose rows are dynamic, at its own
    rows instead: the native products cost more with every row (``DRAFTSMITH_PAD_BLOCKS=1`` pads it as before);
  * every shape is static: attention runs over the cache's whole capacity with the slots past the live
    length masked out (gpt-fast's way), so the graph does not recompile as the context grows; a cache of
    another capacity compiles its own graph (decoders round capacities up to a power of two, and the
    tree-building step-cost measurement uses the same 512 slots).

The computation is one function, `_Core.forward`: the ragged step over a flat run of tokens, each written at
its own cache row and slot, attention chosen per call (one query, a block, one token per row, blocks of many
rows, a prefill, or a mask). `FastBody` runs it for the single-sequence decoder (one cache row), and
`draftsmith.engine.fast_batch.FastBatchBody` for the data engine and the batched decoder (the server's).

A call with more rows than the largest bucket (a long prompt's prefill) runs the same Python function
eagerly. Only the order of floating-point accumulation differs from the Hugging Face forward (as it does
between a 1-row and an 8-row forward of the same model); tests/test_fastpath.py compares the two, and
every losslessness test of the decoder runs through this path too.

Supported: ``model_type`` llama, mistral (no sliding window), qwen2 and qwen3 (no sliding window) with SiLU MLPs
and the default, linear, dynamic or llama3 RoPE (computed by the model's own rotary module), and gemma3_text (Gemma
3: norms scaling by 1 + weight, sandwich norms, the tanh GELU, its score scale, a RoPE per layer type, no logit
soft-capping). Gemma 3's sliding layers attend as full ones do while the live slots fit the window (every query is
then less than a window past every key); past it, a call attends by masked SDPA with the sliding layers' own mask
(the decoder's per-layer-type masks, or the window applied to a causal step), compiled like any masked call, and the
native attention kernels sit out. The batched step (`fast_batch`) takes a windowed target only for a caller that
keeps every row within the window (the data engine). `unsupported` names the reason for any other model, and the
decoder then keeps the Hugging Face forward.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from draftsmith import paths
from draftsmith.engine import blockquant, hugepages
from draftsmith.engine.kvcache import KVCache
from draftsmith.engine.native import (block_for, contiguous_slots, decode_linear, native_for, ragged_block_attention,
                                     ragged_decode_attention, ragged_prefill_attention, rows_linear_dtypes)
from draftsmith.recipe import default_forward
from draftsmith.target import DtypeChoice, resolve_dtype
from draftsmith.targets import shipped_gguf

log = logging.getLogger(__name__)


def frozen_weights():
    """inductor's freezing, on for a compiled call: the weights become constants that inductor packs once for
    oneDNN/MKL (or its CPP GEMM template). Measured on a 2-core AVX-512 Xeon with AMX, 1 thread: a bf16 1-row
    step 44 ms unfrozen, 27 ms frozen and autotuned; 4 rows cost 1.70x a 1-row step in fp32 unfrozen, 1.31x
    frozen."""
    return inductor_config.patch(freezing=True)


GRAPHS_PER_FUNCTION = 64


def allow_graphs() -> None:
    """Raise dynamo's limit of compiled graphs a function (8 by default) to `GRAPHS_PER_FUNCTION`, before a compile.
    Every `FastBody` compiles the same function (`_Core.forward`), and every compiled drafter of a kind its own, each
    under its own guards (module, shapes, cache capacity): past the limit dynamo runs the rest eagerly with nothing
    but a log line (a benchmark holding six compiled lines did: its last two ran 1.3-1.7x slower, and in bf16 with
    other bits)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_FUNCTION)


class CompiledDrafting:
    """What a kind's compiled drafting functions share (Hydra's heads, EAGLE-3's layer): `compile` (static shapes,
    rounding where the eager code casts), `call` (the weights frozen around every call; the first call of each
    new shape ``key`` counted in ``compile_s`` and logged as ``what``)."""

    def __init__(self, what: str):
        self.what, self.compile_s = what, 0.0
        self._seen: set = set()
        allow_graphs()  # one graph per function and shape, and every instance shares the code objects

    @staticmethod
    def compile(module: torch.nn.Module):
        return torch.compile(module, dynamic=False, options={"emulate_precision_casts": True})

    def call(self, fn, key, *args):
        first = key not in self._seen
        t0 = time.perf_counter()
        with frozen_weights():
            out = fn(*args)
        if first:
            self._seen.add(key)
            self.compile_s += time.perf_counter() - t0
            log.info("compiled %s %s in %.1f s", self.what, key, time.perf_counter() - t0)
        return out


BUCKETS = (1, 4, 8, 16, 32)  # graphs compiled by rows; a chain or tree block runs the dynamic one at its own rows
MODES = ("eager", "fast", "compile")  # HF forward | our forward, eager | our forward, compiled where it fits
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")  # the model types our forward computes


def unsupported(model) -> str | None:
    """Why `FastBody` cannot run ``model`` (None when it can)."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        return f"model_type {mt!r} (supported: {', '.join(FAMILIES)})"
    if mt == "gemma3_text":
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, cap, None):
                return f"logit soft-capping ({cap})"
        if getattr(cfg, "use_bidirectional_attention", False):
            return "bidirectional attention"
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            return f"hidden_activation {act!r}"
        types = set(getattr(cfg, "layer_types", None) or ())
        if not types <= {"sliding_attention", "full_attention"}:
            return f"layer types {sorted(types)}"
    else:
        if getattr(cfg, "sliding_window", None) and mt not in ("qwen2", "qwen3"):
            return "sliding-window attention"
        if mt in ("qwen2", "qwen3") and getattr(cfg, "use_sliding_window", False):
            return "sliding-window attention"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    body = model.get_decoder()
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(body, attr):
            return f"the body has no {attr!r}"
    return None


@dataclass
class FastOutput:
    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None


def bucket(q: int) -> int | None:
    """The smallest row bucket holding ``q`` rows (None past the largest)."""
    for b in BUCKETS:
        if q <= b:
            return b
    return None


class _Core(torch.nn.Module):
    """The weights (fused, registered so that inductor's freezing sees them) and the computation."""

    def __init__(self, model):
        super().__init__()
        cfg = model.config
        body = model.get_decoder()
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed = body.embed_tokens  # Gemma's scales its rows by sqrt(hidden) itself
        self.rotary = body.rotary_emb
        self.norm_w = body.norm.weight
        self.head_w = model.get_output_embeddings().weight
        # Gemma 3: norms that scale by 1 + weight (computed in float32, cast after), norms on the attention's and
        # the MLP's outputs too, the tanh GELU, scores scaled by query_pre_attn_scalar ** -0.5, a RoPE per layer
        # type and a sliding window on the sliding layers
        gemma = getattr(cfg, "model_type", None) == "gemma3_text"
        self.norm_offset = self.sandwich = gemma
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if gemma else F.silu
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else self.head_dim ** -0.5
        types = list(getattr(cfg, "layer_types", None) or []) if gemma else []
        # the RoPE of each layer (an index into `rope`'s stacked cos and sin; None: one RoPE for every layer)
        self.rope_types = sorted(set(types)) if types else None
        self.rope_of = [self.rope_types.index(t) for t in types] if types else None
        self.sliding = [t == "sliding_attention" for t in types] or [False] * int(cfg.num_hidden_layers)
        self.window = int(cfg.sliding_window) if any(self.sliding) else None
        P = torch.nn.ParameterList
        self.qkv, self.o, self.ln1, self.ln2, self.gate_up, self.down = P(), P(), P(), P(), P(), P()
        self.post_attn: P | None = P() if gemma else None  # the sandwich norms, by layer
        self.post_mlp: P | None = P() if gemma else None
        self.qkv_b: P | None = None
        self.q_norm: P | None = None  # per-head RMS norms on queries and keys before RoPE (Qwen3), by layer
        self.k_norm: P | None = None
        with torch.no_grad():
            for layer in body.layers:
                a, m = layer.self_attn, layer.mlp
                cat = lambda *ws: torch.nn.Parameter(torch.cat(ws).contiguous(), requires_grad=False)  # noqa: E731
                self.qkv.append(cat(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
                if getattr(a.q_proj, "bias", None) is not None:
                    if self.qkv_b is None:
                        self.qkv_b = P()
                    self.qkv_b.append(cat(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
                if getattr(a, "q_norm", None) is not None:
                    if self.q_norm is None:
                        self.q_norm, self.k_norm = P(), P()
                    self.q_norm.append(a.q_norm.weight)
                    self.k_norm.append(a.k_norm.weight)
                if getattr(a.o_proj, "bias", None) is not None:
                    raise ValueError("the fast decoding forward does not support an output-projection bias")
                self.o.append(a.o_proj.weight)
                self.ln1.append(layer.input_layernorm.weight)
                if self.sandwich:
                    self.post_attn.append(layer.post_attention_layernorm.weight)
                    self.ln2.append(layer.pre_feedforward_layernorm.weight)
                    self.post_mlp.append(layer.post_feedforward_layernorm.weight)
                else:
                    self.ln2.append(layer.post_attention_layernorm.weight)
                self.gate_up.append(cat(m.gate_proj.weight, m.up_proj.weight))
                self.down.append(m.down_proj.weight)
        self.inter = int(self.gate_up[0].shape[0] // 2)
        self.packed = torch.nn.ModuleDict()  # exact low-bit copies of the weights (`pack_weights`), by group
        self.pages: dict | None = None  # what `place_on_huge_pages` did, once it has run
        self.source = str(getattr(cfg, "_name_or_path", "") or "")  # the model's directory: its shipped GGUF
        # one query over a contiguous cache row: the native decode attention kernel (None where it does not apply)
        self.attend_one = native_for(self.norm_w.dtype, self.norm_w.device, self.head_dim)
        # a block of queries (a chain or tree to verify): the same kernel with the block's mask (None: SDPA)
        self.attend_block = block_for(self.norm_w.dtype, self.norm_w.device, self.head_dim)
        # one query per cache row (the batched step): the checked custom op; `FastBatchBody` swaps in the native
        # kernel itself where its caches qualify
        self.attend_rows = ragged_decode_attention
        # float32 on CPU (steps of up to 16 rows) and bf16 except with AMX (any rows on a CPU without bf16
        # instructions, up to 16 with AVX512_BF16) multiply by the native kernel (`decode_linear`), decided here,
        # before any compiled trace; it reads weights row-major, so the ones `cpu_layout` stored column-major for
        # the model's own forward get a row-major copy here (o and down: 146 MB for SmolLM2-135M in float32)
        self.rows_native = (self.norm_w.dtype in rows_linear_dtypes() and self.norm_w.device.type == "cpu")
        if self.rows_native:
            for plist in (self.o, self.down):
                for j, w in enumerate(plist):
                    if not w.is_contiguous():
                        plist[j] = torch.nn.Parameter(w.detach().contiguous(), requires_grad=False)
            if not self.head_w.is_contiguous():
                self.head_w = torch.nn.Parameter(self.head_w.detach().contiguous(), requires_grad=False)

    def lin(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, group: str | None = None,
            i: int = 0) -> torch.Tensor:
        """``x @ w.T (+ b)``; ``group``, ``i``: which weight it is (``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``
        with the layer, or ``"head"``), for its exact packed copy (4, 6 or 8 bits) where `pack_weights` made one."""
        pk = self.packed[group][i] if group is not None and group in self.packed else None
        if pk is not None and not pk.bits:  # a weight of a partly packed group that stays float32
            pk = None
        return decode_linear(x, w, b, native=self.rows_native, packed=pk)

    def weight_groups(self) -> dict[str, list[torch.Tensor]]:
        """The matrices by group, as `lin` names them: every layer's qkv, o, gate_up and down, and the head."""
        return {"qkv": list(self.qkv), "o": list(self.o), "gate_up": list(self.gate_up), "down": list(self.down),
                "head": [self.head_w]}

    def pack_weights(self) -> dict:
        """Find the weights that are exactly 4-bit or 8-bit blocks (a target dequantised from a GGUF file's Q4_1
        and Q8_0 tensors: `draftsmith.engine.blockquant`) and keep packed copies, which decoding steps of up to
        `ROWS_LINEAR_MAX` float32 rows multiply by instead, with the same bits. A group (every layer's qkv, say)
        is packed from its float32 values only if all of its weights are exact; the down and output projections
        that the target's shipped GGUF file stores as Q4_K or Q6_K are then read from it, weight by weight
        (`_k_quant_packs`). The rest stay float32. ``DRAFTSMITH_PACKED=0`` turns it off. Returns what was packed,
        for reports."""
        if (not self.rows_native or self.norm_w.dtype != torch.float32
                or os.environ.get("DRAFTSMITH_PACKED", "1") == "0"):
            return {}
        if len(self.packed):  # packed already (a core the single and batched steps share)
            return self.packed_bits()
        t0 = time.perf_counter()
        groups = self.weight_groups()
        packs = blockquant.pack_groups({k: [w.detach() for w in ws] for k, ws in groups.items()},
                                       cache_dir=paths.home() / "packed")
        packs.update(self._k_quant_packs(groups, packs))
        for name, ps in packs.items():
            self.packed[name] = torch.nn.ModuleList(ps)
        got = self.packed_bits()
        if got:
            fp32 = sum(w.numel() * 4 for name in got for w in groups[name])
            now = sum(p.nbytes if p.bits else w.numel() * 4 for name in got
                      for p, w in zip(self.packed[name], groups[name]))
            log.info("packed the target's exact low-bit weights (%s) for decoding: %.0f MB read a step instead of "
                     "%.0f MB, in %.1f s", ", ".join(f"{k} {v}-bit" for k, v in got.items()), now / 1e6, fp32 / 1e6,
                     time.perf_counter() - t0)
        return got

    def _k_quant_packs(self, groups: dict[str, list[torch.Tensor]], done: dict) -> dict[str, list]:
        """Per weight, from the GGUF file the target ships as: the down and output projections stored as Q4_K or
        Q6_K (`blockquant.K_QUANT_READERS`), whose sub-block scales (an fp16 number times a 6-bit or 8-bit
        integer) the search from float32 values does not find. Each is checked against the float32 weight it
        replaces (`blockquant.exact_for`); a group's other weights stay float32 (a placeholder of 0 bits). Empty
        when the target ships no GGUF file or none of those tensors is a K-quant. ``DRAFTSMITH_PACKED_K=0`` turns
        it off (for a side-by-side measurement)."""
        if os.environ.get("DRAFTSMITH_PACKED_K", "1") == "0":
            return {}
        todo = {"down": "blk.{}.ffn_down.weight", "o": "blk.{}.attn_output.weight"}
        todo = {g: f for g, f in todo.items() if g in groups and g not in done}
        found = shipped_gguf("", self.source) if todo and self.source else None
        if found is None:
            return {}
        try:
            from gguf import GGUFReader
            tensors = {t.name: t for t in GGUFReader(str(found[0])).tensors}
        except Exception as e:  # noqa: BLE001 (an unreadable file packs nothing; decoding stays float32)
            log.warning("not reading %s for its K-quant tensors: %s", found[0], e)
            return {}
        out = {}
        for group, fmt in todo.items():
            ps = []
            for i, w in enumerate(groups[group]):
                t = tensors.get(fmt.format(i))
                read = blockquant.K_QUANT_READERS.get(t.tensor_type.name) if t is not None else None
                p = None
                if read is not None:
                    try:
                        p = read(np.asarray(t.data), w.shape[0], w.shape[1])
                    except ValueError:
                        p = None
                    if p is not None and not blockquant.exact_for(p, w):
                        log.warning("%s in %s does not give the target's float32 weight: left float32",
                                    t.name, found[0])
                        p = None
                ps.append(p if p is not None else blockquant.Packed(
                    torch.zeros(0, dtype=torch.uint8), torch.zeros(0), torch.zeros(0), 0))
            if any(p.bits for p in ps):
                out[group] = ps
        return out

    def place_on_huge_pages(self) -> dict:
        """Move the matrices a decoding step's native kernels read (each group's packed copies where
        `pack_weights` made them, else the weights themselves) into one mapping on 2 MiB pages
        (`draftsmith.engine.hugepages`): the same values on other pages, fewer TLB misses for a step that streams
        them from memory. Parameters keep their identity (their ``.data`` moves, tied ones too); packed copies are
        replaced. Once per core, after `pack_weights`; returns what it did (``mb``, ``huge_mb``), or ``why`` not."""
        if self.pages is not None:
            return self.pages
        why = None if self.rows_native else "the step's products are not the native kernels'"
        why = why or hugepages.why_not()
        if why is not None:
            self.pages = {"why": why}
            return self.pages
        items, seen = [], set()  # (module or None, buffer name or None, tensor)
        for name, ws in self.weight_groups().items():
            packs = self.packed[name] if name in self.packed else None
            for i, w in enumerate(ws):
                pk = packs[i] if packs is not None else None
                if pk is not None and pk.bits:
                    items += [(pk, b, getattr(pk, b)) for b in ("q", "d", "m")]
                elif id(w) not in seen and w.is_contiguous():
                    seen.add(id(w))
                    items.append((None, None, w))
        placed = hugepages.to_huge_pages([t.detach() for _, _, t in items])
        if placed is None:
            self.pages = {"why": "nothing to place"}
            return self.pages
        with torch.no_grad():
            for (mod, buf, t), v in zip(items, placed.tensors):
                if mod is None:
                    t.data = v
                else:
                    setattr(mod, buf, v)
        huge = placed.huge_bytes()
        self.pages = {"mb": round(placed.nbytes / 1e6, 1),
                      "huge_mb": None if huge is None else round(min(huge, placed.nbytes) / 1e6, 1)}
        log.info("decoding weights on 2 MiB pages: %s MB mapped, %s MB of it in huge pages now",
                 self.pages["mb"], self.pages["huge_mb"])
        return self.pages

    def packed_bits(self) -> dict[str, int]:
        """The weight groups `pack_weights` packed, with their bit widths (empty: none); a group of which only some
        weights are packed (the rest float32), or packed at several widths (Q4_K and Q6_K down projections),
        counts as packed at the widest."""
        return {name: max(p.bits for p in ps) for name, ps in self.packed.items()}

    # the computation -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The model's RMS norm: Llama's scales after casting back, Gemma's scales by 1 + weight before it."""
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_offset:
            return (x * (1.0 + w.float())).to(dt)
        return w * x.to(dt)

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for the positions ``pos`` [T] (or [types, T, 1, head_dim], one per layer type,
        for a model with a RoPE per type: Gemma 3's), by the model's own rotary module, computed eagerly (outside
        the compiled graph, whose vectorised cos/sin round differently)."""
        if self.rope_types is not None:
            cs = [self.rotary(self.norm_w, pos[None], t) for t in self.rope_types]
            return torch.stack([c[0][:, None] for c, _ in cs]), torch.stack([s_[0][:, None] for _, s_ in cs])
        cos, sin = self.rotary(self.norm_w, pos[None])
        return cos[0][:, None], sin[0][:, None]

    def qkv_in(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's attention inputs for the states ``h`` [..., hidden]: q, k, v, flat per token (heads x dim)."""
        nh, nk, d = self.n_heads, self.n_kv, self.head_dim
        x = self._rms(h, self.ln1[i])
        qkv = self.lin(x, self.qkv[i], None if self.qkv_b is None else self.qkv_b[i], "qkv", i)
        return qkv.split([nh * d, nk * d, nk * d], dim=-1)

    @staticmethod
    def mark_rope_dynamic(cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Mark the tokens' dimension of `rope`'s tables dynamic for a compiled graph: the first of [T, 1, dim], the
        second of [types, T, 1, dim]."""
        for t in (cos, sin):
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 3)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the last dimension (the model's rotate-half convention)."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def layer_out(self, i: int, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Layer i's residual stream after its attention output ``att`` (flat per token) and its MLP."""
        o = self.lin(att, self.o[i], None, "o", i)
        h = h + (self._rms(o, self.post_attn[i]) if self.sandwich else o)
        x = self._rms(h, self.ln2[i])
        gu = self.lin(x, self.gate_up[i], None, "gate_up", i)
        m = self.lin(self.act(gu[..., :self.inter]) * gu[..., self.inter:], self.down[i], None, "down", i)
        return h + (self._rms(m, self.post_mlp[i]) if self.sandwich else m)

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor | None,
                slots: torch.Tensor, kv: list[torch.Tensor], attn: str, a: tuple = (),
                logits: bool | torch.Tensor = True, taps: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """The one ragged step, for prefill, decoding and verification alike: every layer over the flat run of
        tokens ``ids`` [T] (token t at the position whose cos, sin [T, 1, head_dim] `rope` gave), token t's key
        and value written at slot ``slots[t]`` of cache row ``rows[t]`` (``rows`` None: a one-row cache), then
        attention by ``attn``, with its tensors ``a``:

          * ``"mask"`` (mask [1, 1, T, e], and optionally the sliding layers' own): a one-row cache, SDPA over its
            first e slots with that additive mask;
          * ``"one"`` (last [1]): one query over slots [0, last] of a one-row cache (`attend_one`);
          * ``"block"`` (last [T], allow [T, T] bool): a block in a one-row cache, query j at slot last[j] seeing
            every slot before last[0] and block slot last[0] + i where allow[j, i] (`attend_block`);
          * ``"rows"`` (last [T]): token t alone in cache row t, over its slots [0, last[t]] (`attend_rows`);
          * ``"blocks"`` (brows [n], starts [n + 1], last [T], allow [n, m, m]): n blocks one after the other,
            block g (tokens starts[g] to starts[g + 1]) in cache row brows[g], each as ``"block"``
            (`ragged_block_attention`);
          * ``"prefill"`` (g_rows, starts, offsets): prompts as one flat run (`ragged_prefill_attention`).

        kv: the cache's key and value buffers, layer by layer ([rows, kv_heads, capacity, head_dim]).
        ``logits``: True for every token's, False for none, or the indices of the tokens whose logits are wanted.
        Returns the final normed states [T, hidden], the logits (or None) and the outputs of the layers in
        ``taps`` (0-based), in that order."""
        t = ids.shape[0]
        h = self.embed(ids)
        nh, nk, d = self.n_heads, self.n_kv, self.head_dim
        scale = self.scale
        tapped = {}
        for i in range(len(self.qkv)):
            qs, ks, vs = self.qkv_in(i, h)
            qs, ks = qs.view(t, nh, d), ks.view(t, nk, d)
            if self.q_norm is not None:  # Qwen3, Gemma 3: each head's queries and keys RMS-normed before RoPE
                qs, ks = self._rms(qs, self.q_norm[i]), self._rms(ks, self.k_norm[i])
            c, s_ = (cos, sin) if self.rope_of is None else (cos[self.rope_of[i]], sin[self.rope_of[i]])
            qs = self.rotate(qs, c, s_)
            ks = self.rotate(ks, c, s_)
            vs = vs.view(t, nk, d)
            kc, vc = kv[2 * i], kv[2 * i + 1]
            if rows is None:
                kc.index_copy_(2, slots, ks.transpose(0, 1)[None])
                vc.index_copy_(2, slots, vs.transpose(0, 1)[None])
            else:
                kc[rows, :, slots] = ks
                vc[rows, :, slots] = vs
            if attn == "one":  # the native decode kernel reads only the live slots
                att = self.attend_one(qs, kc, vc, a[0], scale)
            elif attn == "block":  # the decode kernel with the block's mask, over the live slots only
                att = self.attend_block(qs, kc, vc, a[0], a[1], scale)
            elif attn == "rows":
                att = self.attend_rows(qs, kc, vc, a[0], scale)
            elif attn == "blocks":
                att = ragged_block_attention(qs, kc, vc, a[0], a[1], a[2], a[3], scale)
            elif attn == "prefill":
                att = ragged_prefill_attention(qs, kc, vc, a[0], a[1], a[2], scale)
            elif attn == "mask":  # a[1], where given: the sliding layers' mask (their window applied)
                mk = a[1] if len(a) > 1 and self.sliding[i] else a[0]
                e = mk.shape[-1]
                att = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], kc[:, :, :e], vc[:, :, :e],
                                                     attn_mask=mk, scale=scale,
                                                     enable_gqa=nk != nh)[0].transpose(0, 1)
            else:
                raise ValueError(f"unknown attention {attn!r}")
            h = self.layer_out(i, h, att.reshape(t, nh * d))
            if i in taps:
                tapped[i] = h
        h = self._rms(h, self.norm_w)
        if isinstance(logits, bool):
            lg = self.lin(h, self.head_w, None, "head") if logits else None
        else:
            lg = self.lin(h[logits], self.head_w, None, "head")
        return h, lg, tuple(tapped[i] for i in taps)


class FastBody(torch.nn.Module):
    """The target body (and LM head) as one static-shape function; see the module docstring.

    Args:
      model: a Llama-family causal LM (`unsupported` is None for it); its weights are copied fused.
      compile: compile with inductor (weights frozen into the graph) for calls of up to 32 rows.
      pack: decoding steps multiply the weights that are exactly 4-bit or 8-bit blocks (a target dequantised
        from a GGUF file) from packed copies, with the same bits as from float32 (`_Core.pack_weights`).
      cpp_wrapper: the 1-row graph of plain decoding and chain drafting (one query by the native decode kernel)
        calls its kernels from inductor's C++ wrapper instead of generated Python; default: on, on CPU, unless
        ``DRAFTSMITH_CPP_WRAPPER=0``. Same kernels, same results; on a 2-core AVX2 EPYC the graph's own time
        falls from 4.0 to 2.2 ms a step (float32), and its first compile takes about 50 s longer (inductor's
        on-disk cache serves later processes).
    """

    def __init__(self, model, compile: bool = True, autotune: bool = True, cpp_wrapper: bool | None = None,
                 pack: bool = True):
        super().__init__()
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the fast decoding forward does not support this model: {why}")
        self.core = _Core(model)
        if pack:  # decoding steps multiply from exact 4/8-bit copies where they exist (`_Core.pack_weights`)
            self.core.pack_weights()
        self.core.place_on_huge_pages()  # what the step reads, on 2 MiB pages (`draftsmith.engine.hugepages`)
        # the model's own layers, not registered (their weights live fused in `core`): forward hooks put on them
        # (EAGLE-3 reads three layers' outputs that way) are called with the same outputs, see `_call_hooks`
        self._layers = list(model.get_decoder().layers)
        self.dtype = self.core.norm_w.dtype
        self.compiled = None
        self.compile_s = 0.0  # seconds spent in the first calls of new compiled shapes
        self.hot: set[int] = set()  # the row buckets decoders asked for (`reserve`): the only ones compiled
        # blocks (chains, trees) attend by the native block kernel where it applies; DRAFTSMITH_BLOCK_ATTENTION=0:
        # masked SDPA over the whole capacity, as before
        self.block_native = os.environ.get("DRAFTSMITH_BLOCK_ATTENTION", "1") != "0"
        # block graphs with their rows dynamic: one compile serves the 4-, 8- and 16-row buckets;
        # DRAFTSMITH_DYNAMIC_BLOCKS=0 compiles each bucket on its own (static shapes, as before)
        self.dynamic_blocks = os.environ.get("DRAFTSMITH_DYNAMIC_BLOCKS", "1") != "0"
        # DRAFTSMITH_PAD_BLOCKS=1: a block's rows padded up to its bucket on the dynamic graph too (as before)
        self.pad_blocks = os.environ.get("DRAFTSMITH_PAD_BLOCKS", "0") == "1"
        self._seen: set = set()
        if compile:
            allow_graphs()
            # freezing (`frozen_weights`, set around the calls: passed in torch.compile's options it is silently not
            # applied in torch 2.13, the weights stay graph inputs and every GEMM a plain aten::mm): the weights
            # become constants, packed once for oneDNN/MKL or, autotuned, for the CPP GEMM template where it
            # wins; emulate_precision_casts: round where the eager code casts (the norms compute in float32, as
            # the model's own do), so a float64 or bf16 model computes what it computes eagerly
            opts = {"emulate_precision_casts": True}
            if autotune:
                opts.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
            self.compiled = torch.compile(self.core, dynamic=False, options=opts)
            if cpp_wrapper is None:
                cpp_wrapper = (os.environ.get("DRAFTSMITH_CPP_WRAPPER", "1") != "0"
                               and self.core.norm_w.device.type == "cpu")
            # the 1-row graph: one kernel call per op from C++, not Python (a separate compile, its own backend)
            self.compiled_one = (torch.compile(self.core, dynamic=False, options={**opts, "cpp_wrapper": True})
                                 if cpp_wrapper else self.compiled)

    @property
    def packed(self) -> dict[str, int]:
        """The weight groups decoding steps multiply from packed copies, with their bit widths (empty: none)."""
        return self.core.packed_bits()

    def step_bytes(self) -> int:
        """Bytes of weights a decoding step of up to 16 rows reads: the matrices (packed where `pack_weights` packed
        them, else in the model's dtype) and the norms; the embedding's one row left out."""
        c = self.core
        total = sum(p.numel() * p.element_size() for p in [*c.ln1, *c.ln2, c.norm_w])
        for name, ws in c.weight_groups().items():
            if name in c.packed:
                total += sum(p.nbytes if p.bits else w.numel() * w.element_size() for p, w in zip(c.packed[name], ws))
            else:
                total += sum(w.numel() * w.element_size() for w in ws)
        return total

    def reserve(self, rows: int) -> None:
        """A decoder will run forwards of up to ``rows`` rows: compile the bucket that holds them (on first use).
        A call pads its rows up to the smallest reserved bucket that holds them; one that no reserved bucket
        holds (a long prompt's prefill) runs eagerly. So a decoder compiles its 1-row graph and the graph of its
        largest step, and nothing for the odd sizes a step takes near the end of a generation."""
        b = bucket(rows)
        if b is not None:
            self.hot.add(b)

    # the body's calling convention -----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, past_key_values=None,
                use_cache: bool = True, want_logits: bool = True, logits_from: int = 0, **kwargs) -> FastOutput:
        """The body's forward over ``input_ids`` [1, q], written into ``cache`` at its write start. ``logits_from``:
        the logits of rows ``logits_from..q-1`` only (a fused prefill wants the last rows': the LM head over a
        hundred prompt rows is a fifth of their products)."""
        if kwargs.get("output_hidden_states"):
            raise ValueError("FastBody does not return intermediate hidden states (forward hooks on the model's "
                             "layers are called with their outputs); use the model's body")
        cache = cache if cache is not None else past_key_values
        if not isinstance(cache, KVCache) or cache.n_rows != 1:
            raise ValueError("FastBody needs the decoder's pre-allocated one-row KVCache")
        dev = input_ids.device
        q = int(input_ids.shape[1])
        s = int(cache.write_start)
        e = s + q
        if position_ids is None:
            position_ids = torch.arange(s, e, device=dev)[None]
        slid = None  # the sliding layers' mask, where their window reaches into this call's slots
        if isinstance(attention_mask, dict):  # per layer type (`kvcache.window_masks`)
            attention_mask, slid = attention_mask["full_attention"], attention_mask["sliding_attention"]
        sees_all = attention_mask is None  # a row that sees every slot so far (`_one_query`)
        if attention_mask is None:
            allowed = torch.ones(q, e, dtype=torch.bool, device=dev).tril(diagonal=s)
            attention_mask = torch.zeros(1, 1, q, e, dtype=self.dtype, device=dev)
            attention_mask.masked_fill_(~allowed, torch.finfo(attention_mask.dtype).min)
        win = self.core.window
        # within the window a sliding layer attends as a full one does: positions are below the live end e (a
        # slot's position is at most its index), so no query is win or more past a key before e passes win
        windowed = win is not None and e > win
        if not windowed:
            slid = None
        elif slid is None:
            if not sees_all:
                raise ValueError(f"the target's sliding layers attend over the last {win} positions: past them "
                                 "FastBody needs their own mask ({'full_attention': ..., 'sliding_attention': ...})")
            far = (position_ids[0][:, None] - torch.arange(e, device=dev)[None]) >= win  # slot j holds position j
            slid = attention_mask.masked_fill(far[None, None], torch.finfo(attention_mask.dtype).min)
        masks = (attention_mask,) if slid is None else (attention_mask, slid)  # for the masked paths
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        taps = hooked_layers(self._layers)
        b = min((h for h in self.hot if h >= q), default=None) if self.compiled is not None else None
        C = int(cache.capacity)
        ids, pos = input_ids[0], position_ids[0]
        if b is None or s + b > C:
            # eager: a block of up to the largest bucket's rows attends by the native block kernel where it
            # applies (as the compiled graphs do), anything longer (a prompt) by SDPA
            allow = (self._block_mask(kv, attention_mask, s, q, q)
                     if self.block_native and q <= BUCKETS[-1] and not windowed else None)
            slots_e = torch.arange(s, e, device=dev)
            attn, a = ("block", (slots_e, allow)) if allow is not None else ("mask", masks)
            lg_at = (torch.arange(logits_from, q, device=dev) if logits_from else True) if want_logits else False
            h, lg, outs = self.core(ids, *self.core.rope(pos), None, slots_e, kv, attn, a, logits=lg_at, taps=taps)
            outs = tuple(o[None] for o in outs)
            self._call_hooks(taps, outs)
            return FastOutput(h[None], None if lg is None else lg[None])
        if q == 1 and b == 1 and not windowed and self._one_query(kv, None if sees_all else attention_mask):
            # one query that sees every slot so far (plain decoding, drafting a chain): the native decode kernel
            # over slots [0, s], its length a tensor, so the shape stays static without masking the capacity
            slots = torch.arange(s, s + 1, device=dev)
            return self._run_compiled((1, C, str(dev), taps, "one"), taps, ids, pos, slots, kv, q, "one",
                                      (slots,), logits_from)
        allow = None
        if self.block_native and not windowed:
            # a chain or tree block that sees every slot before it: the native kernel with the block's mask reads
            # the live slots only (masked SDPA below reads the whole capacity for every row). The block graph's
            # rows are dynamic (`_run_compiled`), so a block of 2 or more rows runs at its own rows, not padded up
            # to its bucket: the native products cost more with every row; the bucket still decides whether the
            # compiled graph serves the call
            rows = q if self.dynamic_blocks and not self.pad_blocks and q > 1 else b
            allow = self._block_mask(kv, attention_mask, s, q, rows)
            if allow is not None:
                b = rows
        slots = torch.arange(s, s + b, device=dev)
        pad = b - q
        if pad:
            ids = torch.cat([ids, ids[-1:].expand(pad)])
            pos = torch.cat([pos, pos[-1:].expand(pad)])
        if allow is not None:
            return self._run_compiled((b, C, str(dev), taps, "block"), taps, ids, pos, slots, kv, q, "block",
                                      (slots, allow), logits_from)
        # every shape static: b rows over the whole capacity, the slots past the live length masked out
        # (gpt-fast's way; dynamic live lengths got specialised by the trace and recompiled on every step)
        padded = tuple(self._capacity_mask(mk, q, b, e, C) for mk in masks)
        return self._run_compiled((b, C, str(dev), taps, len(masks)), taps, ids, pos, slots, kv, q, "mask", padded,
                                  logits_from)

    @staticmethod
    def _capacity_mask(mask: torch.Tensor, q: int, b: int, e: int, C: int) -> torch.Tensor:
        """``mask`` [1, 1, q, e] as [1, 1, b, C]: the slots past e masked out, a padded row seeing only itself."""
        m = torch.full((1, 1, b, C), torch.finfo(mask.dtype).min, dtype=mask.dtype, device=mask.device)
        m[:, :, :q, :e] = mask
        if b > q:
            m[0, 0, torch.arange(q, b), torch.arange(e, e + b - q)] = 0
        return m

    def _block_mask(self, kv: list[torch.Tensor], attention_mask: torch.Tensor, s: int, q: int, b: int
                    ) -> torch.Tensor | None:
        """The block's mask as ``allow`` [b, b] for `_Core.forward` (padded rows see only themselves), where the
        native block kernel applies and the caller's mask [1, 1, q, s + q] lets every row see every slot before
        the block; None otherwise (the masked SDPA path)."""
        if self.core.attend_block is None or s == 0 or not contiguous_slots(kv[0], kv[1]):
            return None
        mk = attention_mask[0, 0]
        if mk.shape != (q, s + q) or bool(mk[:, :s].ne(0).any()):
            return None
        allow = torch.eye(b, dtype=torch.bool, device=mk.device)
        allow[:q, :q] = mk[:, s:].eq(0)
        return allow

    def _one_query(self, kv: list[torch.Tensor], attention_mask: torch.Tensor | None) -> bool:
        """Whether a 1-row call can attend by the native decode kernel: it applies (dtype, device, head size), the
        cache's slots are contiguous, and the caller's mask (None: none given) lets the query see every slot so
        far."""
        if self.core.attend_one is None or not contiguous_slots(kv[0], kv[1]):
            return False
        return attention_mask is None or not bool(attention_mask.ne(0).any())

    def _run_compiled(self, key: tuple, taps: tuple[int, ...], ids, pos, slots, kv, q: int, attn: str, a: tuple,
                      logits_from: int = 0) -> FastOutput:
        first = key not in self._seen
        if first:
            self._seen.add(key)
            t0 = time.perf_counter()
        fn = self.compiled_one if attn == "one" else self.compiled
        cos, sin = self.core.rope(pos)
        if attn == "block" and self.dynamic_blocks:
            # one graph for every block bucket (4, 8, 16 rows): their products are the native kernels' (no GEMM to
            # specialise on the rows) and their attention the block kernel's. On a 2-core AVX2 EPYC (Zen 1) this
            # saved a ~55-s compile a bucket, the step costs the same (benchmarks.step_cost, docs/results-log.md §43)
            for t in (ids, pos, slots, a[0]):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            self.core.mark_rope_dynamic(cos, sin)
            torch._dynamo.maybe_mark_dynamic(a[1], 0)
            torch._dynamo.maybe_mark_dynamic(a[1], 1)
        graphs = _unique_graphs()
        with frozen_weights():
            h, lg, outs = fn(ids, cos, sin, None, slots, kv, attn, a, taps=taps)
        if first and _unique_graphs() == graphs:  # a new bucket that an earlier graph serves: nothing compiled
            log.info("the decoding forward for %d rows over a %d-slot cache runs the graph compiled for another "
                     "block size", key[0], key[1])
        elif first:
            self.compile_s += time.perf_counter() - t0
            log.info("compiled the decoding forward for %d rows over a %d-slot cache%s%s in %.1f s", key[0], key[1],
                     f" (outputs of layers {list(taps)} kept for hooks)" if taps else "",
                     {"block": ", a block by the native block kernel",
                      "one": ", one query by the native decode kernel"}.get(attn, ""), time.perf_counter() - t0)
        h, lg, outs = h[None, :q], lg[None, :q], tuple(o[None, :q] for o in outs)
        if logits_from:
            lg = lg[:, logits_from:]
        self._call_hooks(taps, outs)
        return FastOutput(h, lg)

    def _call_hooks(self, taps: tuple[int, ...], outs: tuple[torch.Tensor, ...]) -> None:
        call_layer_hooks(self._layers, taps, outs)


def _unique_graphs() -> int:
    """Graphs dynamo has compiled in this process (a call that compiled nothing leaves it unchanged)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def call_layer_hooks(layers, taps: tuple[int, ...], outs: tuple[torch.Tensor, ...]) -> None:
    """Call the forward hooks of the model's ``layers`` in ``taps`` with their outputs of a forward of ours, as the
    model's own forward would (``hook(layer, args, output)``; the args are not available: empty)."""
    for i, out in zip(taps, outs):
        layer = layers[i]
        for hid, hook in list(layer._forward_hooks.items()):
            if hid in layer._forward_hooks_with_kwargs:
                hook(layer, (), {}, (out,))
            else:
                hook(layer, (), (out,))


def hooked_layers(layers) -> tuple[int, ...]:
    """The indices of the model's layers that carry forward hooks (a drafter reading their outputs)."""
    return tuple(i for i, layer in enumerate(layers) if layer._forward_hooks)


def use_fast_forward(target, mode: str = "compile", autotune: bool = True) -> dict:
    """Make every decoder built on ``target`` from now on use our forward (``mode`` "fast": eager;
    "compile": compiled where it fits) or, with "eager", the model's own forward. Returns what was done,
    for the report: a model the fast forward does not support keeps its own, with the reason."""
    if mode not in MODES:
        raise ValueError(f"decoding forward must be one of {MODES}, got {mode!r}")
    if mode == "eager":
        target.fast_body = None
        return {"forward": "eager"}
    why = unsupported(target.model)
    if why is not None:
        log.warning("the fast decoding forward does not support %s (%s): keeping the model's own", target.name, why)
        target.fast_body = None
        return {"forward": "eager", "why": why}
    have = getattr(target, "fast_body", None)
    if have is not None and (have.compiled is not None) == (mode == "compile"):
        return {"forward": mode}  # already there: keep its compiled graphs
    target.fast_body = FastBody(target.model, compile=mode == "compile", autotune=autotune)
    _shared_cores[target.model] = target.fast_body.core
    return {"forward": mode}


_shared_cores: "weakref.WeakKeyDictionary[torch.nn.Module, _Core]" = weakref.WeakKeyDictionary()


def shared_core(model) -> _Core | None:
    """The fused weights of the `FastBody` that `use_fast_forward` put on ``model``'s target, for the batched step
    to run the same step on the same weights (one copy in memory); None if there is none."""
    return _shared_cores.get(model)


FULL_WIDTH_GGUF = ("f32", "f16", "bf16")


def decode_dtype(dtype: str | None, target: str, device: str = "cpu", forward: str = "compile") -> DtypeChoice:
    """The dtype one-at-a-time decoding (the trees' step costs, the bench, `draftsmith eval`) runs ``target`` in
    for a recipe's or the command line's ``dtype``: `resolve_dtype`'s choice, except that ``auto`` on a CPU gives
    float32 where the target ships as a low-bit GGUF file (the default target's Q4_1, the named ones' Q4_K_M),
    decoding uses our forward (``fast`` or ``compile``) and the native kernels build: a float32 step then reads
    the file's packed 4/8-bit blocks with the float32 model's arithmetic (`FastBody.pack_weights`; 115 MB a step
    for the default target against 270 MB in bf16), which measured faster than bf16 at every verification width
    on a CPU with AVX512_BF16 and no AMX (1 row 9.5 against 19.1 ms, 16 rows 31.9 against 49.1 ms on a 2-core
    Zen 5 EPYC) and at up to 4 rows on a Xeon with AMX (docs/results-log.md §45). ``auto`` still means bf16 for the
    data engine's wide batched steps, which `resolve_dtype` decides."""
    choice = resolve_dtype(dtype, device)
    if dtype != "auto" or torch.device(device).type != "cpu" or choice.dtype == torch.float32 or forward == "eager":
        return choice
    spec = str(target)
    shipped = shipped_gguf(spec, spec if Path(spec).is_dir() else None)
    if shipped is None or shipped[1].lower() in FULL_WIDTH_GGUF:
        return choice
    if os.environ.get("DRAFTSMITH_PACKED", "1") == "0" or torch.float32 not in rows_linear_dtypes():
        return choice
    return DtypeChoice(torch.float32, "float32", f"auto: decoding reads the {shipped[1].upper()} file the target "
                       "ships as from its packed blocks in float32, fewer bytes a step than bf16 (the data engine's "
                       f"batched steps stay in {choice.name})")


def add_forward_arg(ap, default: str | None = None) -> None:
    """``--forward eager|fast|compile`` on an argparse parser: the target forward decoders use. The default is
    ``$DRAFTSMITH_FORWARD`` if set, else compile (`draftsmith.recipe.default_forward`)."""
    ap.add_argument("--forward", choices=list(MODES), default=default or default_forward(),
                    help="the target's decoding forward: compile = our static-shape forward compiled with inductor "
                         "(a minute or two of compiling once per row bucket, then the fastest), fast = the same "
                         "forward eager, eager = the model's own forward (default: %(default)s)")
