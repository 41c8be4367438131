"""DFlash drafting as one static-shape function compiled with inductor, for decoders whose target forward is compiled.

Eager DFlash drafting concatenates each layer's context keys again every step and runs a dozen small products with
Python around them. Here the same math (`DFlashModule.context_kv`, `block`, `project`) runs as one compiled function
with the drafter's weights frozen into it (inductor packs them once, as for the target in
`draftsmith.engine.fastpath`), over one pre-allocated key/value buffer per draft layer and generation
(`draftsmith.common.layers.LayerKV`):

  * slots ``[0, C)`` (C: the decoder's capacity) hold each layer's keys and values of the context of the committed
    positions fed so far; slots ``C .. C + S - 1`` the block's (S: the block size), overwritten every step;
  * one call feeds the positions committed since the last step (their fused target states: keys and values written
    at their slots), then runs the block [newest token, mask x (S - 1)] over the context and itself, and returns its
    slots' draft logits in target-id space, the mask token's at the dtype's minimum (as `DFlashDrafter` does).

The new positions are padded up to a bucket (1, 4, 8, 16, 32): a padded row writes its keys at a slot past the
committed ones, which no block reads before a real position overwrites it. A prompt's positions (more than a bucket)
run the same function eagerly. On CPU the drafter's linear layers and head default to weight-only int8 where that
product is the faster one (`draftsmith.common.int8`), as the other kinds' compiled drafting does; the drafter's
numbers only shape q, so that changes which tokens are drafted, never the output's distribution
(tests/test_dflash_fast.py compares the two paths and runs the exactness checks through this one).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.common.int8 import compute_copy, drafting_dtype, int8_by_default, logits_in, quantised
from draftsmith.common.layers import LayerKV
from draftsmith.common.vocab import TargetIdHead
from draftsmith.engine.fastpath import CompiledDrafting, bucket


class _Core(nn.Module):
    """The drafter's fusion, layers, norm and head (``int8``: quantised copies); the target's embedding shared."""

    def __init__(self, module: nn.Module, int8: bool):
        super().__init__()
        self.fc = quantised(module.fc) if int8 else module.fc
        self.hidden_norm, self.norm, self.embed = module.hidden_norm, module.norm, module.embed
        self.layers = nn.ModuleList(quantised(lay) if int8 else lay for lay in module.layers)
        self.head = TargetIdHead(module, int8, dtype=module.fc.weight.dtype)
        self.mask_id = int(module.config.mask_token_id)

    def forward(self, feats: torch.Tensor, cpos: torch.Tensor, cslots: torch.Tensor, ids: torch.Tensor,
                pos: torch.Tensor, bslots: torch.Tensor, mask: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        """New context rows (target states feats [n, k x H] at positions cpos, written at slots cslots [n]); the
        block ids [S] at positions pos [S], its keys at slots bslots [S]; mask [S, slots] additive; kv: each layer's
        keys and values buffers -> the draft logits of slots 1..S-1 [S - 1, V]."""
        ctx = self.hidden_norm(self.fc(feats))
        h = self.embed(ids).to(ctx.dtype)
        for i, lay in enumerate(self.layers):
            keys, values = kv[2 * i], kv[2 * i + 1]
            ck, cv = lay.kv(ctx, cpos)
            keys.index_copy_(1, cslots, ck)
            values.index_copy_(1, cslots, cv)
            q, k, v = lay.qkv(lay.attention_input(h), pos)
            keys.index_copy_(1, bslots, k)
            values.index_copy_(1, bslots, v)
            h = lay.finish(h, lay.attend(q, keys, values, mask))
        logits = self.head(self.norm(h[1:]))
        return logits.index_fill(1, torch.tensor([self.mask_id], device=logits.device), torch.finfo(logits.dtype).min)


class FastDFlash:
    """Compiled drafting for a `DFlashModule` (see the module docstring). ``compile=False`` runs the same function
    eagerly (the tests compare it with the module's own drafting); ``int8`` (default: `int8_by_default`) quantises
    the drafter's linear layers and head. The weights are frozen when a graph is first compiled: a drafter whose
    weights change afterwards needs a new `FastDFlash` (a new decoder drafter, as a published checkpoint gets)."""

    def __init__(self, module: nn.Module, compile: bool = True, int8: bool | None = None,
                 dtype: torch.dtype | None = None):
        if module.training:
            raise ValueError("FastDFlash drafts with the module in eval mode: call module.eval() first")
        p = module.fc.weight
        # default: the module's dtype, bf16 for a float32 one on a CPU with native bf16 (`drafting_dtype`)
        self.dtype, self.out_dtype = dtype or drafting_dtype(p), p.dtype
        if int8 is None:
            int8 = int8_by_default(torch.empty(0, dtype=self.dtype, device=p.device))
        self.module, self.int8, self.block_size = module, bool(int8), int(module.block_size)
        self.fn = _Core(compute_copy(module, self.dtype), self.int8)
        self.calls = CompiledDrafting("DFlash drafting")
        self._compiled = self.calls.compile(self.fn) if compile else None

    @property
    def compile_s(self) -> float:
        return self.calls.compile_s

    def new_kv(self, capacity: int) -> list[LayerKV]:
        """Each draft layer's buffers: ``capacity`` context slots and the block's."""
        w = self.module.fc.weight
        return [LayerKV.empty(lay, capacity, self.block_size, dtype=self.dtype, device=w.device)
                for lay in self.module.layers]

    @torch.no_grad()
    def draft(self, kv: list[LayerKV], feats: torch.Tensor, start: int, root: int) -> torch.Tensor:
        """Feed positions start..start+n-1 (target states ``feats`` [n, k x H]) into the context, then draft the block
        whose first token ``root`` sits at position start + n -> the draft logits of its slots 1..S-1 [S - 1, V]."""
        n, dev, dtype = feats.shape[0], feats.device, self.dtype
        C, S = kv[0].capacity, self.block_size
        L = start + n
        if L > C:
            raise ValueError(f"DFlash drafter: positions up to {L} do not fit its {C}-slot buffer")
        b = bucket(n) if n else None  # nothing new to feed (not a step's case): eagerly, over no rows
        eager = self._compiled is None or b is None or start + b > C
        if eager:
            b = n
        pad = b - n
        x = torch.cat([feats, feats[-1:].expand(pad, -1)]) if pad else feats
        cslots = torch.arange(start, start + b, device=dev)
        cpos = cslots.clone()
        ids = torch.full((S,), self.module.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = root
        pos = torch.arange(L, L + S, device=dev)
        bslots = torch.arange(C, C + S, device=dev)
        mask = torch.full((S, C + S), torch.finfo(dtype).min, dtype=dtype, device=dev)
        mask[:, :L] = 0
        mask[:, C:] = 0
        buffers = [t for layer_kv in kv for t in (layer_kv.keys, layer_kv.values)]
        args = (x.to(dtype), cpos, cslots, ids, pos, bslots, mask, buffers)
        if eager:
            return logits_in(self.fn(*args), self.out_dtype)
        return logits_in(self.calls.call(self._compiled, ("draft", b, C, S, str(dev)), *args), self.out_dtype)
