"""Hydra(++) drafting as static-shape functions compiled with inductor, for decoders whose target forward is compiled.

Eager drafting with Hydra++ heads costs a decoding step about as much as a quarter of the target's own forward on
a CPU (a 2-core Xeon with AMX, bf16, 1 thread: 6.7 ms of drafting per step of a 7-node tree against 27.8 ms for a
1-row target step): some thirty small products and their Python around them, for one or a few rows each. Here the
same math runs as two kinds of compiled graph, each with the heads' weights frozen into it (inductor packs them
once, as for the target in `draftsmith.engine.fastpath`):

  * the prefix layer's incremental step over a pre-allocated key/value buffer of the decoder's capacity (the
    eager layer concatenates its cache at every step): the new rows padded up to a bucket (1, 4, 8, 16, 32),
    attention over the whole buffer with the slots past the live length masked out, a padded row writing past
    the live entries (overwritten by the next step's rows) and attending only to itself; the prompt's rows (more
    than a bucket) run the same function eagerly;
  * one head for the nodes of one depth: the path tokens' embeddings, the head's layers, and the draft LM head
    (with a pruned vocabulary, its kept rows, scattered back into target-id space with the dtype's minimum
    elsewhere, exactly as `PrunedHead.to_target`), rows padded to a bucket.

On CPU the heads' linear layers (the prefix layer's, the heads' and the draft LM head) default to weight-only
int8 (`draftsmith.common.int8`): after the target's forward has streamed its weights, the drafter's come from DRAM
again, and reading half the bytes is what makes drafting cheaper (docs/results-log.md §16.5).

The drafter's numbers only shape q; verification is exact whatever q is, so compiled or int8 drafting changes
which tokens are drafted, never the output's distribution (tests/test_hydra_fast.py checks the compiled logits
against the eager ones, int8 against the heads' own weights, and runs the enumeration and greedy-equality checks
through both).
The weights are frozen when a graph is first compiled: heads whose weights change afterwards need a new
`FastHydra` (a new decoder drafter), as a published checkpoint gets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.int8 import cast_copy, drafting_dtype, int8_by_default, quantised
from draftsmith.common.layers import LayerKV
from draftsmith.engine.fastpath import CompiledDrafting, bucket


class _PrefixCore(nn.Module):
    """The prefix layer's step over pre-allocated keys and values: the layer's own phases (`DecoderLayer`), its
    own weights."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x [T, d] at positions ``pos`` [T]; mask [T, C] additive over the buffer's C slots; the T new keys and
        values go to ``slots`` of ``keys``/``values`` [kv_heads, C, head_dim] -> out [T, d]."""
        p = self.layer
        q, k, v = p.qkv(p.attention_input(x), pos)
        keys.index_copy_(1, slots, k)
        values.index_copy_(1, slots, v)
        a = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask[None, None],
                                           enable_gqa=p.nkv != p.nh, scale=p.scale)[0]
        return p.finish(x, a)


class _DepthCore(nn.Module):
    """Head i for the nodes of one depth: (base [1, d], paths [n, i]) -> (states [n, d], logits [n, V]).
    ``int8``: the heads' and the draft LM head's weights quantised (`draftsmith.common.int8`), the embeddings
    shared. ``dtype``: the heads and the draft LM head run in a copy in this dtype (the embeddings' rows and
    ``base`` cast to it), the logits come out in ``out_dtype`` (the dtype's minimum at pruned ids)."""

    def __init__(self, heads: nn.Module, int8: bool = False, dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None):
        super().__init__()
        dtype = dtype or next(heads.parameters()).dtype
        self.dtype, self.out_dtype = dtype, out_dtype or dtype
        self.embed = heads.embed
        dh = heads.draft_head
        body, out = cast_copy(heads.heads, dtype), cast_copy(dh if dh is not None else heads.lm_head, dtype)
        self.heads = quantised(body) if int8 else body
        self.out = quantised(out) if int8 else out
        self.vocab_size = int(dh.vocab_size) if dh is not None else None
        if dh is not None:
            self.register_buffer("kept_ids", dh.kept_ids.clone())

    def forward(self, base: torch.Tensor, paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, i = paths.shape
        base = base.to(self.dtype)
        states = self.heads[i - 1](base.expand(n, -1), self.embed(paths).to(self.dtype))
        kept = self.out(states).to(self.out_dtype)
        if self.vocab_size is None:
            return states, kept
        full = kept.new_full((n, self.vocab_size), torch.finfo(kept.dtype).min)
        return states, full.index_copy(1, self.kept_ids, kept)


class FastHydra:
    """Compiled drafting for `HydraHeads` (see the module docstring). ``compile=False`` runs the same functions
    eagerly (the tests compare the two)."""

    def __init__(self, heads: nn.Module, compile: bool = True, int8: bool | None = None,
                 dtype: torch.dtype | None = None):
        if heads.training:
            raise ValueError("FastHydra drafts with heads in eval mode (dropout off): call heads.eval() first")
        p = next(heads.parameters())
        # default: the heads' dtype, bf16 for float32 heads on a CPU with native bf16 (`drafting_dtype`)
        self.dtype = dtype or drafting_dtype(p)
        if int8 is None:  # default: int8 weights where the CPU's int8 product is the faster one for this dtype
            int8 = int8_by_default(torch.empty(0, dtype=self.dtype, device=p.device))
        self.heads, self.int8 = heads, bool(int8)
        pre = heads.prefix
        if pre is not None:
            pre = cast_copy(pre, self.dtype)
        self.prefix = _PrefixCore(quantised(pre) if int8 else pre) if pre is not None else None
        self.depth = _DepthCore(heads, int8=self.int8, dtype=self.dtype, out_dtype=p.dtype)
        self.calls = CompiledDrafting("Hydra drafting")
        self._prefix_c = self.calls.compile(self.prefix) if compile and self.prefix is not None else None
        self._depth_c = self.calls.compile(self.depth) if compile else None
        self._call = self.calls.call

    @property
    def compile_s(self) -> float:
        return self.calls.compile_s

    def new_kv(self, capacity: int) -> LayerKV:
        p = self.heads.prefix
        return LayerKV.empty(p, capacity, dtype=self.dtype, device=p.input_norm.weight.device)

    @torch.no_grad()
    def prefix_step(self, kv: LayerKV, rows: torch.Tensor, start: int) -> torch.Tensor:
        """Base states [n, d] of ``rows`` (hidden states at positions start..start+n-1), their keys and values
        written into ``kv``."""
        rows = rows.to(self.dtype)
        n, dev = rows.shape[0], rows.device
        C = kv.capacity
        if start + n > C:
            raise ValueError(f"prefix layer: positions up to {start + n} do not fit its {C}-slot buffer")
        b = bucket(n)
        eager = self._prefix_c is None or b is None or start + b > C
        if eager:  # the prompt's rows, or a step that would run past the buffer: no padding, run uncompiled
            b = n
        pad = b - n
        x = torch.cat([rows, rows[-1:].expand(pad, -1)]) if pad else rows
        slots = torch.arange(start, start + b, device=dev)
        pos = torch.cat([slots[:n], slots[n - 1:n].expand(pad)]) if pad else slots
        mask = torch.full((b, C), torch.finfo(rows.dtype).min, dtype=rows.dtype, device=dev)
        mask[:n, :start + n].masked_fill_(torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(start), 0)
        if pad:
            mask[torch.arange(n, b, device=dev), slots[n:]] = 0  # a padded row sees only itself
        if eager:
            return self.prefix(x, pos, mask, slots, kv.keys, kv.values)
        out = self._call(self._prefix_c, ("prefix", b, C, str(dev)), x, pos, mask, slots, kv.keys, kv.values)
        return out[:n]

    @torch.no_grad()
    def depth_logits(self, base: torch.Tensor, paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``paths.shape[1]``'s states [n, d] and draft logits [n, V] (target-id space) for ``paths`` [n, i]."""
        paths = paths[:, : self.heads.num_heads]
        n = paths.shape[0]
        b = bucket(n)
        if self._depth_c is None or b is None:
            return self.depth(base, paths)
        p = torch.cat([paths, paths[-1:].expand(b - n, -1)]) if b > n else paths
        st, lg = self._call(self._depth_c, ("depth", b, paths.shape[1], str(paths.device)), base, p)
        return (st[:n], lg[:n]) if b > n else (st, lg)

