"""DFlash decoding: the drafter module as a `draftsmith.engine.decoder.SpeculativeDecoder` drafter.

The target states DFlash fuses come from forward hooks on those layers (`draftsmith.common.taps.LayerTap`): every
target forward the decoder runs (the prefill, each verification) leaves them behind, and ``commit`` keeps the
rows of the accepted path. So the decoder's own forward is untouched and verification is the engine's.

Per step (state.length = L; the root token t_L is the newest token, not yet in the target's cache):
  * the root's call fuses the committed positions not fed yet (fed..L-1) into the context and appends each layer's
    keys and values of them to this drafter's context cache, then runs one block [t_L, MASK x (S-1)] at positions
    L..L+S-1 over it: slot k's logits are the draft distribution of t_{L+k};
  * the mask token is never drafted (its logit at the dtype's minimum);
  * a tree node at depth d gets slot d+1's logits: the block's slots do not read the drafted tokens, so every
    node of a depth shares one distribution (chains, and static or dynamic trees of its top tokens, verify
    losslessly all the same: each draft is sampled from, and verified against, the distribution it came from).
Nothing of a block is kept: the next step feeds the accepted positions' true states and drafts a new block.
Drafter state is replaced, never mutated in place, so cloned decode states never share it.

When the decoder's target forward is compiled, the same step runs through `FastDFlash` (drafters/dflash/fast.py)
over pre-allocated key buffers written in place: a copied state (``copy.copy``) clones them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.common.taps import LayerTap, TappedDrafter
from draftsmith.engine.policies import LengthPolicy
from draftsmith.engine.trees import DraftTree

if TYPE_CHECKING:  # the model module builds these drafters: importing it here would be a cycle
    from draftsmith.drafters.dflash.model import DFlashModule


@dataclass
class _State:
    ctx: list  # per layer (keys, values) [nkv, fed, hd] of the context of positions 0..fed-1
    fed: int
    feats: torch.Tensor  # [n, n_layers x H] target states of positions fed..fed+n-1, not fed yet
    root_len: int = -1  # the L whose block's logits are below
    logits: torch.Tensor | None = None  # [S-1, V] slot k's draft logits at row k-1 (target-id space)

    def pending(self, feats: torch.Tensor) -> "_State":
        """This state with ``feats`` to feed next (nothing of this step's block kept)."""
        return _State(self.ctx, self.fed, feats)


@dataclass
class _CompiledState:
    """Compiled drafting (`FastDFlash`): each layer's context keys live in a pre-allocated buffer written in place,
    so a copied state gets its own buffers."""
    kv: list  # per draft layer a common.layers.LayerKV: context at slots 0..fed-1, the block after the capacity
    fed: int
    feats: torch.Tensor
    root_len: int = -1
    logits: torch.Tensor | None = None

    def pending(self, feats: torch.Tensor) -> "_CompiledState":
        return _CompiledState(self.kv, self.fed, feats)

    def __copy__(self) -> "_CompiledState":
        return _CompiledState([copy.copy(k) for k in self.kv], self.fed, self.feats, self.root_len, self.logits)


class DFlashDrafter(TappedDrafter):
    """Drafts with a DFlash module; see the module docstring. ``commit``, ``observe_step`` and batched decoding:
    `TappedDrafter`."""

    needs_target_hidden = True  # the prefill runs first, so the hooks hold the prompt's states at start
    supports_trees = True
    any_range = True  # a node's children depend on its depth only: any node range can be proposed

    def __init__(self, target, module: "DFlashModule", target_fingerprint: str | None = None, name: str = "dflash",
                 policy: LengthPolicy | None = None):
        self.target, self.module = target, module.eval().requires_grad_(False)
        self.name, self.target_fingerprint = name, target_fingerprint
        self.default_policy = policy
        self.max_depth = module.block_size - 1
        self._fast: Any = None  # the module's compiled drafting (``module.fast_drafting()``), built on first use
        self.tap = LayerTap(target, module.target_layers, "DFlash")

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling this drafter's graphs (0 when it drafts eagerly)."""
        return float(getattr(self._fast, "compile_s", 0.0))

    # ------------------------------------------------------------------ decoder interface
    @torch.no_grad()
    def start(self, dec, state) -> _State:
        L, m = state.length, self.module
        feats = self.tap.features() if L > 0 else m.fc.weight.new_zeros(0, m.fc.in_features)
        if feats.shape[0] != L:
            raise RuntimeError(f"DFlash needs the target's states of the {L} committed tokens at start; the last "
                               f"forward gave {feats.shape[0]} rows")
        dtype = m.dtype()
        fb, make = getattr(dec, "fast", None), getattr(m, "fast_drafting", None)
        if fb is not None and fb.compiled is not None and make is not None:
            # the decoder's target forward is compiled: so is drafting
            if self._fast is None:
                self._fast = make()
            return _CompiledState(self._fast.new_kv(dec.capacity), 0, feats.to(dtype))
        empty = feats.new_zeros(m.config.num_kv_heads, 0, m.config.head_dim, dtype=dtype)
        return _State([(empty, empty) for _ in m.layers], 0, feats.to(dtype))

    def _draft(self, ds, state):
        """Feed the committed positions fed..L-1 into the context, then draft the block at L."""
        m, L, S = self.module, state.length, self.module.block_size
        n = L - ds.fed
        if ds.feats.shape[0] != n:
            raise RuntimeError(f"DFlash holds target states for {ds.feats.shape[0]} positions, {n} are committed")
        if isinstance(ds, _CompiledState):
            logits = self._fast.draft(ds.kv, ds.feats, ds.fed, int(state.tokens[L]))
            return _CompiledState(ds.kv, L, ds.feats[:0], L, logits)
        dev = ds.feats.device
        ctx = ds.ctx
        if n:
            new = m.context_kv(m.fuse(ds.feats), torch.arange(ds.fed, L, device=dev))
            ctx = [(torch.cat([k0, k], dim=-2), torch.cat([v0, v], dim=-2)) for (k0, v0), (k, v) in zip(ctx, new)]
        ids = torch.full((S,), m.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = int(state.tokens[L])
        h = m.block(ids, torch.arange(L, L + S, device=dev), ctx, None)
        logits = m.project(h[1:])
        if m.draft_head is not None:
            logits = m.draft_head.to_target(logits)
        # the mask token is the block's filler, never a draft (training learns that; an untrained block whose
        # head is the tied, scaled embedding of its own mask input would draft nothing else)
        logits[:, m.config.mask_token_id] = torch.finfo(logits.dtype).min
        return _State(ctx, L, ds.feats[:0], L, logits)

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor | None:
        if state.length == 0:
            return None  # a one-token prompt: no target state yet to draft from (this step decodes plainly)
        ds: _State = state.drafter_state
        if ds.root_len != state.length:
            ds = state.drafter_state = self._draft(ds, state)
        # nodes at the deepest level may be in the range without needing children: clamp their rows
        depths = [min(d, ds.logits.shape[0] - 1) for d in tree.depth[start:end]]
        if len(set(depths)) == 1:
            return ds.logits[depths[0]].expand(end - start, -1)
        return ds.logits[torch.tensor(depths, device=ds.logits.device)]
