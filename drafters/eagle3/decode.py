"""EAGLE-3 decoding: the drafter module as a `draftsmith.engine.decoder.SpeculativeDecoder` drafter.

The target states EAGLE-3 fuses (outputs of three decoder layers) come from forward hooks on those layers:
every target forward the decoder runs (the prefill, each verification) leaves them behind, and ``commit``
keeps the rows of the accepted path. So the decoder's own forward is untouched and verification is the
engine's, for chains, static trees and dynamic trees alike.

Per step (state.length = L, the root token t_L not yet in the target's cache):
  * the root's call feeds step 0 over the committed indices not fed yet (target state f_j with token
    t_{j+1}, j < L), appending their keys to this drafter's prefix keys; its output at index L-1 gives the
    root's children;
  * a tree node at depth d >= 1 is step d at index L-1 (RoPE position L-1+d): input its parent's output
    state and its own token; it attends to the prefix keys and to its ancestors' and its own keys.
Nothing of a step's tree is kept: the next step feeds the accepted tokens again, from the target's true
states. Drafter state is replaced, never mutated in place, so cloned decode states never share it.

When the decoder's target forward is compiled, the same steps run through `FastEagle3` (drafters/eagle3/fast.py)
over a pre-allocated key buffer that is written in place: a copied state (``copy.copy``) clones it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.common.taps import LayerTap, TappedDrafter
from draftsmith.engine.policies import LengthPolicy
from draftsmith.engine.trees import DraftTree

if TYPE_CHECKING:  # the model module builds these drafters: importing it here would be a cycle
    from draftsmith.drafters.eagle3.model import Eagle3Module


@dataclass
class _State:
    k0: torch.Tensor  # [nkv, fed, hd] step-0 keys of indices 0..fed-1
    v0: torch.Tensor
    fed: int
    feats: torch.Tensor  # [n, 3H] target states of indices fed..fed+n-1, not fed yet
    root_len: int = -1  # the L whose root output is below
    root_out: torch.Tensor | None = None  # [H] step 0's output at index L-1
    nk: torch.Tensor | None = None  # [nkv, m, hd] keys of this step's nodes 1..m
    nv: torch.Tensor | None = None
    nout: list = field(default_factory=list)  # output state of node i (index 0: the root)

    def pending(self, feats: torch.Tensor) -> "_State":
        """This state with ``feats`` to feed next (nothing of this step's tree kept)."""
        return _State(self.k0, self.v0, self.fed, feats)


@dataclass
class _FastState:
    """Compiled drafting (`FastEagle3`): the keys live in a pre-allocated buffer, written in place, so a copied
    state gets its own buffer."""
    kv: Any  # common.layers.LayerKV: prefix keys at slots 0..fed-1, this step's node i at slot capacity + i - 1
    fed: int
    feats: torch.Tensor  # [n, 3H] target states of indices fed..fed+n-1, not fed yet
    root_len: int = -1
    root_out: torch.Tensor | None = None
    root_logits: torch.Tensor | None = None  # [V] the root's draft logits (target-id space)
    nout: list = field(default_factory=list)

    def pending(self, feats: torch.Tensor) -> "_FastState":
        return _FastState(self.kv, self.fed, feats)

    def __copy__(self) -> "_FastState":
        return _FastState(copy.copy(self.kv), self.fed, self.feats, self.root_len, self.root_out, self.root_logits,
                          list(self.nout))


class Eagle3Drafter(TappedDrafter):
    """Drafts with an EAGLE-3 module; see the module docstring. ``commit``, ``observe_step`` and batched decoding:
    `TappedDrafter`."""

    needs_target_hidden = True  # the prefill runs first, so the hooks hold the prompt's states at start
    supports_trees = True

    def __init__(self, target, module: "Eagle3Module", target_fingerprint: str | None = None, name: str = "eagle3",
                 policy: LengthPolicy | None = None):
        self.target, self.module = target, module.eval().requires_grad_(False)
        self.name, self.target_fingerprint = name, target_fingerprint
        self.default_policy = policy
        self.max_depth = None
        self._fast: Any = None  # the module's compiled drafting (``module.fast_drafting()``), built on first use
        self.tap = LayerTap(target, module.aux_layers, "EAGLE-3")

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling this drafter's graphs (0 when it drafts eagerly)."""
        return float(getattr(self._fast, "compile_s", 0.0))

    # ------------------------------------------------------------------ decoder interface
    @torch.no_grad()
    def start(self, dec, state) -> _State:
        L = state.length
        m = self.module
        dtype = m.fc.weight.dtype
        # a one-token prompt has nothing committed: no prefill ran, nothing to read
        feats = self.tap.features() if L > 0 else m.fc.weight.new_zeros(0, m.fc.in_features)
        if feats.shape[0] != L:
            raise RuntimeError(f"EAGLE-3 needs the target's states of the {L} committed tokens at start; the last "
                               f"forward gave {feats.shape[0]} rows")
        fb, make = getattr(dec, "fast", None), getattr(m, "fast_drafting", None)
        if fb is not None and fb.compiled is not None and make is not None:
            # the decoder's target forward is compiled: so is drafting
            if self._fast is None:
                self._fast = make()
            return _FastState(self._fast.new_kv(dec.capacity), 0, feats.to(dtype))
        empty = feats.new_zeros(m.layer.nkv, 0, m.layer.hd, dtype=dtype)
        return _State(empty, empty, 0, feats.to(dtype))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [nh, r, hd] over keys k, v [nkv, S, hd] where mask [r, S] allows."""
        lay = self.module.layer
        s = (q @ lay.expand(k).transpose(-1, -2)) / math.sqrt(lay.hd)
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ lay.expand(v)

    def _feed(self, ds: _State, state) -> _State:
        """Step 0 over the committed indices fed..L-1: their keys join the prefix; returns the new state."""
        m, lay, L = self.module, self.module.layer, state.length
        c = ds.fed
        n = L - c
        if ds.feats.shape[0] != n:
            raise RuntimeError(f"EAGLE-3 holds target states for {ds.feats.shape[0]} indices, {n} are committed")
        dev = ds.feats.device
        ids = torch.tensor(state.tokens[c + 1: L + 1], dtype=torch.long, device=dev)
        pos = torch.arange(c, L, device=dev)
        h = m.fuse(ds.feats)
        q, k, v = lay.qkv(lay.attention_input(m.embed_tokens(ids), h), pos)
        k0, v0 = torch.cat([ds.k0, k], dim=1), torch.cat([ds.v0, v], dim=1)
        mask = torch.ones(n, L, dtype=torch.bool, device=dev).tril(c)
        out = lay.finish(h, self._attend(q, k0, v0, mask))
        return _State(k0, v0, L, ds.feats[:0], L, out[-1])

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor | None:
        if state.length == 0:
            return None  # a one-token prompt: no target state yet to draft from (this step decodes plainly)
        if isinstance(state.drafter_state, _FastState):
            return self._propose_fast(state, tree, start, end)
        ds: _State = state.drafter_state
        m, lay, L = self.module, self.module.layer, state.length
        dev = ds.k0.device
        rows = []
        if start == 0:
            if ds.root_len != L:
                ds = self._feed(ds, state)
            ds = _State(ds.k0, ds.v0, ds.fed, ds.feats, ds.root_len, ds.root_out, None, None, [ds.root_out])
            state.drafter_state = ds
            rows.append(ds.root_out[None])
            start = 1
        if end > start:
            parents = [int(tree.parent[i]) for i in range(start, end)]
            h_in = m.carry(torch.stack([ds.nout[p] for p in parents]))  # the parents' outputs as a next step reads them
            pos = (L - 1) + torch.tensor(tree.depth[start:end], device=dev)
            q, k, v = lay.qkv(lay.attention_input(m.embed_tokens(tree.tok[start:end]), h_in), pos)
            nk = k if ds.nk is None else torch.cat([ds.nk, k], dim=1)
            nv = v if ds.nv is None else torch.cat([ds.nv, v], dim=1)
            anc = tree.ancestor_mask(dev)[start:end, 1:end]  # ancestors and self among nodes 1..end-1
            mask = torch.cat([torch.ones(end - start, L, dtype=torch.bool, device=dev), anc], dim=1)
            out = lay.finish(h_in, self._attend(q, torch.cat([ds.k0, nk], 1), torch.cat([ds.v0, nv], 1), mask))
            state.drafter_state = _State(ds.k0, ds.v0, ds.fed, ds.feats, ds.root_len, ds.root_out, nk, nv,
                                         ds.nout + list(out))
            rows.append(out)
        logits = m.project(torch.cat(rows) if len(rows) > 1 else rows[0])
        return m.draft_head.to_target(logits) if m.draft_head is not None else logits

    def _propose_fast(self, state, tree: DraftTree, start: int, end: int) -> torch.Tensor:
        """`propose` through the compiled functions (`FastEagle3`): the same steps over the pre-allocated keys."""
        ds: _FastState = state.drafter_state
        fast, L = self._fast, state.length
        rows = []
        if start == 0:
            if ds.root_len != L:
                ids = torch.tensor(state.tokens[ds.fed + 1: L + 1], dtype=torch.long, device=ds.feats.device)
                if ds.feats.shape[0] != L - ds.fed:
                    raise RuntimeError(f"EAGLE-3 holds target states for {ds.feats.shape[0]} indices, "
                                       f"{L - ds.fed} are committed")
                out, logits = fast.feed(ds.kv, ds.feats, ids, ds.fed)
                ds = _FastState(ds.kv, L, ds.feats[:0], L, out, logits)
            ds = state.drafter_state = replace(ds, nout=[ds.root_out])  # this step's tree starts at the root
            rows.append(ds.root_logits[None])
            start = 1
        if end > start:
            kv = ds.kv
            need = start - 1 + fast.node_rows(end - start)
            if need > kv.node_slots:  # a larger tree than any before: a larger buffer, what it holds copied over
                kv = kv.grown(max(need, 2 * kv.node_slots))
            dev = tree.tok.device
            h_in = torch.stack([ds.nout[int(tree.parent[i])] for i in range(start, end)])  # carried in `nodes`
            anc = tree.ancestor_mask(dev)[start:end, 1:end]
            out, logits = fast.nodes(kv, h_in, tree.tok[start:end], list(tree.depth[start:end]), start, anc, L)
            state.drafter_state = replace(ds, kv=kv, nout=ds.nout + list(out))
            rows.append(logits)
        return torch.cat(rows) if len(rows) > 1 else rows[0]

