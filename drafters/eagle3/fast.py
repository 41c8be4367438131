"""EAGLE-3 drafting as static-shape functions compiled with inductor, for decoders whose target forward is compiled.

Eager EAGLE-3 drafting costs 10-12 ms a decoding step on a 2-core Xeon with AMX in bf16 (docs/results-log.md §17),
against a 15 ms target step: per call a few products of one to a few rows each, the prefix keys concatenated
again, and Python around them. Here the same math runs as two compiled functions with the drafter's weights frozen
into them (inductor packs them once, as for the target in `draftsmith.engine.fastpath`), over one pre-allocated
key/value buffer per generation:

  * slots ``[0, C)`` (C: the decoder's capacity) hold step 0's keys of the committed indices (the prefix), slots
    ``C + i - 1`` the keys of this step's tree node i (i >= 1), overwritten by the next step's nodes;
  * ``feed``: step 0 over the committed indices not fed yet (fused target states, the next tokens), their keys
    written at their slots, attention over the whole buffer with what a row may not see masked out, and the draft
    logits of the last row (the root's children);
  * ``nodes``: step d for tree nodes at depth d (their parents' output states and their own tokens), keys written
    at the nodes' slots, attending to the prefix and to their ancestors and themselves, and their draft logits.

Rows are padded up to a bucket (1, 4, 8, 16, 32): a padded row writes its key to a slot no real row reads before
it is overwritten and attends only to itself. The prompt's rows (more than a bucket) run the same function eagerly.
On CPU the drafter's linear layers and its draft head default to weight-only int8 (`draftsmith.common.int8`), as
Hydra++'s compiled drafting does. The drafter's numbers only shape q: verification is exact whatever q is, so this
changes which tokens are drafted, never the output's distribution (tests/test_eagle3_fast.py compares it with the
eager drafter and runs the enumeration and greedy-equality checks through it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.int8 import compute_copy, drafting_dtype, int8_by_default, logits_in, quantised
from draftsmith.common.layers import LayerKV
from draftsmith.common.vocab import TargetIdHead
from draftsmith.engine.fastpath import CompiledDrafting, bucket


def fuse_states(x: torch.Tensor, fc: nn.Module, input_norm: nn.Module | None,
                fc_norm: nn.ModuleList | None) -> torch.Tensor:
    """[..., 3H] -> [..., H]: the norms EAGLE 3.1 asks for (one over the concatenation, one per state), then
    ``fc`` (eager drafting and training pass the module's, compiled drafting its int8 copy)."""
    if input_norm is not None:
        x = input_norm(x)
    if fc_norm is not None:
        x = torch.cat([norm(part) for norm, part in zip(fc_norm, x.chunk(3, dim=-1))], dim=-1)
    return fc(x)


class _Core(nn.Module):
    """The drafter's layer, norm and draft head (``int8``: quantised copies), the target's embedding shared."""

    def __init__(self, module: nn.Module, int8: bool):
        super().__init__()
        self.fc = quantised(module.fc) if int8 else module.fc
        self.input_norm, self.fc_norm = module.input_norm, module.fc_norm  # EAGLE 3.1's norms (None: off)
        self.norm_output = bool(module.config.norm_output)
        self.layer = quantised(module.layer) if int8 else module.layer
        self.norm = module.norm
        self.head = TargetIdHead(module, int8, dtype=module.fc.weight.dtype)
        self.embed = module.embed

    def step(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Input states h [T, H] with tokens ids [T] at RoPE positions pos [T]; their keys and values go to
        ``slots`` of ``keys``/``values`` [kv_heads, S, head_dim]; mask [T, S] additive -> output states [T, H]."""
        lay = self.layer
        q, k, v = lay.qkv(lay.attention_input(self.embed(ids).to(h.dtype), h), pos)
        keys.index_copy_(1, slots, k)
        values.index_copy_(1, slots, v)
        a = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask[None, None],
                                           enable_gqa=lay.nkv != lay.nh)[0]
        return lay.finish(h, a)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return fuse_states(feats, self.fc, self.input_norm, self.fc_norm)

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """A parent's output state -> what its children's step reads (`Eagle3Module.carry`)."""
        return self.norm(out) if self.norm_output else out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Output states [n, H] -> draft logits [n, V] in target-id space (the dtype's minimum off the kept ids,
        as `PrunedHead.to_target`)."""
        return self.head(self.norm(x))


class _Feed(nn.Module):
    def __init__(self, core: _Core):
        super().__init__()
        self.core = core

    def forward(self, feats, ids, pos, mask, slots, keys, values, last):
        """feats [T, 3H] -> (output states [T, H], draft logits [1, V] of row ``last`` [1])."""
        c = self.core
        out = c.step(c.fuse(feats), ids, pos, mask, slots, keys, values)
        return out, c.logits(out.index_select(0, last))


class _Nodes(nn.Module):
    def __init__(self, core: _Core):
        super().__init__()
        self.core = core

    def forward(self, h, ids, pos, mask, slots, keys, values):
        """Parents' output states h [T, H] -> (the nodes' output states [T, H], their draft logits [T, V])."""
        c = self.core
        out = c.step(c.carry(h), ids, pos, mask, slots, keys, values)
        return out, c.logits(out)


class FastEagle3:
    """Compiled drafting for an `Eagle3Module` (see the module docstring). ``compile=False`` runs the same functions
    eagerly (the tests compare the two); ``int8`` (default: on CPU in bf16/fp16, `int8_by_default`) quantises the
    drafter's linear layers and head. The weights are frozen when a graph is first compiled: a drafter whose
    weights change afterwards needs a new `FastEagle3` (a new decoder drafter, as a published checkpoint gets)."""

    def __init__(self, module: nn.Module, compile: bool = True, int8: bool | None = None, node_slots: int = 64,
                 dtype: torch.dtype | None = None):
        if module.training:
            raise ValueError("FastEagle3 drafts with the module in eval mode: call module.eval() first")
        p = module.fc.weight
        # default: the module's dtype, bf16 for a float32 one on a CPU with native bf16 (`drafting_dtype`)
        self.dtype, self.out_dtype = dtype or drafting_dtype(p), p.dtype
        if int8 is None:  # default: int8 weights where the CPU's int8 product is the faster one for this dtype
            int8 = int8_by_default(torch.empty(0, dtype=self.dtype, device=p.device))
        self.module, self.int8, self.node_slots = module, bool(int8), int(node_slots)
        core = _Core(compute_copy(module, self.dtype), self.int8)
        self.feed_fn, self.nodes_fn = _Feed(core), _Nodes(core)
        self.calls = CompiledDrafting("EAGLE-3 drafting")
        self._feed_c = self.calls.compile(self.feed_fn) if compile else None
        self._nodes_c = self.calls.compile(self.nodes_fn) if compile else None
        self._call = self.calls.call

    @property
    def compile_s(self) -> float:
        return self.calls.compile_s

    def new_kv(self, capacity: int, nodes: int | None = None) -> LayerKV:
        w = self.module.fc.weight
        return LayerKV.empty(self.module.layer, capacity, nodes or self.node_slots, dtype=self.dtype, device=w.device)

    def _mask(self, b: int, S: int, dtype, dev) -> torch.Tensor:
        """[b, S] additive mask, everything hidden (rows fill in what they see)."""
        return torch.full((b, S), torch.finfo(dtype).min, dtype=dtype, device=dev)

    @torch.no_grad()
    def feed(self, kv: LayerKV, feats: torch.Tensor, ids: torch.Tensor,
             start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 over indices start..start+n-1 (fused target states ``feats`` [n, 3H], next tokens ``ids`` [n]):
        their keys written into ``kv`` -> (the last row's output state [H], its draft logits [V])."""
        n, dev, dtype = feats.shape[0], feats.device, self.dtype
        C, S = kv.capacity, int(kv.keys.shape[1])
        if start + n > C:
            raise ValueError(f"EAGLE-3 drafter: indices up to {start + n} do not fit its {C}-slot buffer")
        b = bucket(n)
        eager = self._feed_c is None or b is None or start + b > C
        if eager:
            b = n
        pad = b - n
        x = torch.cat([feats, feats[-1:].expand(pad, -1)]) if pad else feats
        ids = torch.cat([ids, ids[-1:].expand(pad)]) if pad else ids
        slots = torch.arange(start, start + b, device=dev)
        pos = torch.cat([slots[:n], slots[n - 1:n].expand(pad)]) if pad else slots
        mask = self._mask(b, S, dtype, dev)
        mask[:n, :start + n].masked_fill_(torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(start), 0)
        if pad:
            mask[torch.arange(n, b, device=dev), slots[n:]] = 0  # a padded row sees only itself
        last = torch.tensor([n - 1], device=dev)
        args = (x.to(dtype), ids, pos, mask, slots, kv.keys, kv.values, last)
        out, logits = (self.feed_fn(*args) if eager
                       else self._call(self._feed_c, ("feed", b, C, S, str(dev)), *args))
        return out[n - 1], logits_in(logits[0], self.out_dtype)

    def node_rows(self, n: int) -> int:
        """The rows a call for ``n`` nodes runs (its bucket when compiled)."""
        b = bucket(n)
        return n if self._nodes_c is None or b is None else b

    @torch.no_grad()
    def nodes(self, kv: LayerKV, h: torch.Tensor, ids: torch.Tensor, depth: list[int], first: int,
              anc: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree nodes first..first+n-1 of this step (parents' output states h [n, H], their tokens ids [n], their
        depths), each attending to the prefix 0..L-1 and to the nodes ``anc`` [n, first+n-1] marks (ancestors and
        itself among nodes 1..first+n-1) -> (their output states [n, H], their draft logits [n, V])."""
        n, dev, dtype = h.shape[0], h.device, self.dtype
        C, S = kv.capacity, int(kv.keys.shape[1])
        b = self.node_rows(n)
        eager = self._nodes_c is None or bucket(n) is None
        last_node = first + n - 1
        if first - 1 + b > kv.node_slots:
            raise ValueError(f"EAGLE-3 drafter: nodes up to {first - 1 + b} do not fit its {kv.node_slots} node slots")
        pad = b - n
        x = torch.cat([h, h[-1:].expand(pad, -1)]) if pad else h
        ids = torch.cat([ids, ids[-1:].expand(pad)]) if pad else ids
        slots = C + torch.arange(first - 1, first - 1 + b, device=dev)
        d = torch.tensor(depth, device=dev)
        pos = (L - 1) + (torch.cat([d, d[-1:].expand(pad)]) if pad else d)
        mask = self._mask(b, S, dtype, dev)
        mask[:n, :L] = 0
        mask[:n, C: C + last_node].masked_fill_(anc, 0)
        if pad:
            mask[torch.arange(n, b, device=dev), slots[n:]] = 0
        args = (x.to(dtype), ids, pos, mask, slots, kv.keys, kv.values)
        if eager:
            out, logits = self.nodes_fn(*args)
        else:
            out, logits = self._call(self._nodes_c, ("nodes", b, C, S, str(dev)), *args)
        return out[:n], logits_in(logits[:n], self.out_dtype)

