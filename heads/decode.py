"""Decoding with heads on the target's last hidden state (Medusa, Hydra, Hydra++), single and batched.

`HeadDrafter` is the decoder-side drafter of both head kinds (draftsmith.engine.drafters gives the protocol):
  * Medusa: head k reads the target's hidden state at the last committed position and proposes the token k+1
    ahead;
  * a head module that also reads the drafted tokens (Hydra) implements ``draft_states(base [1, d], paths
    [n, k+1]) -> [n, d]`` (head k+1), where each path is the root followed by the k drafted tokens above the new
    node, and ``base_step(rows, start, past)`` for its base state (Hydra++'s prefix layer reads every committed
    position's hidden state, from ``state.fresh_hidden``).

`HeadRows` is its batched adapter (``HeadDrafter.batch_adapter``): one drafter call serves every live row of
`draftsmith.engine.batched.BatchedSpeculativeDecoder`. Medusa's K heads run once on the stacked hidden states of
every row; path-reading heads (Hydra) get one call per depth over the stacked bases and paths of every row; a
prefix layer (Hydra++) advances per row through the drafter's own ``_base`` (its keys and values are per row).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

import torch

from draftsmith.engine import drafters as engine  # engine.project looked up per call (step_breakdown wraps it)
from draftsmith.engine.trees import DraftTree


@dataclass
class _HeadState:
    logits: torch.Tensor | None = None  # [K, V] Medusa logits for this step
    base: torch.Tensor | None = None  # [1, d] Hydra's base state at length-1 (after the prefix layer)
    fed: int = 0  # Hydra++: positions [0, fed) went through the prefix layer
    past: tuple | None = None  # Hydra++: the prefix layer's keys and values (replaced, never mutated)
    hidden: torch.Tensor | None = None  # Hydra: the last head states computed (features for length policies)
    pending: list | None = None  # batched Hydra++: unread hidden states, one chunk per step (joined when read)
    kv: Any = None  # compiled drafting (`fast_drafting`): the prefix layer's pre-allocated keys and values
    fast: bool = False  # this generation drafts through the compiled functions

    def __copy__(self) -> "_HeadState":
        c = _HeadState(**{f.name: getattr(self, f.name) for f in fields(self)})
        if self.kv is not None:  # a pre-allocated buffer is written in place: a copied state gets its own
            c.kv = copy.copy(self.kv)
        return c


class HeadDrafter:
    """Heads that read the target's last hidden state (after the final norm).

    Medusa head k at position t predicts t+k+1. At a step the root sits at
    position L and the hidden state available is the one at L-1, so the
    children of a depth-d node (position L+d+1) come from head d+1. All K heads
    are projected in one call (with a shared LM head: one matmul).
    """

    def __init__(self, heads: torch.nn.Module, target_fingerprint: str | None = None, name: str = "medusa"):
        self.heads = heads
        self.name = name
        self.target_fingerprint = target_fingerprint
        self.max_depth = int(getattr(heads, "num_heads"))
        self.needs_target_hidden = True  # the decoder prefills the target before the first draft
        self.reads_path = callable(getattr(heads, "draft_states", None))
        self.has_prefix = getattr(heads, "prefix", None) is not None
        self._fast: Any = None  # the heads' compiled drafting (``heads.fast_drafting()``), built on first use
        self.any_range = True  # a node's children depend on its path only: any node range can be proposed

    def start(self, dec, state) -> _HeadState:
        fb = getattr(dec, "fast", None)
        make = getattr(self.heads, "fast_drafting", None)
        if fb is None or fb.compiled is None or make is None:
            return _HeadState()
        # the decoder's target forward is compiled: so is drafting (heads that offer it, e.g. Hydra++)
        if self._fast is None:
            self._fast = make()
        kv = self._fast.new_kv(dec.capacity) if self.has_prefix else None
        return _HeadState(kv=kv, fast=True)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling this drafter's graphs (0 when it drafts eagerly)."""
        return float(getattr(self._fast, "compile_s", 0.0))

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor | None:
        if state.hidden is None:  # one-token prompt: no hidden state yet
            return None
        ds: _HeadState = state.drafter_state
        if self.reads_path:
            return self._path_logits(state, ds, tree, start, end)
        if ds.logits is None:
            # Only heads 1..D feed a draft of depth D: a 4-node tree of depth 2 projects 2 heads, not K.
            n = state.draft_depth or self.max_depth  # the decoder caps draft_depth at max_depth
            shared = getattr(self.heads, "proj", "absent") is None and getattr(self.heads, "lm_head", None) is not None
            if shared:  # Medusa with the target's LM head: one product for the heads the draft reads
                ds.logits = self._project(self.heads.head_states(state.hidden)[:n, 0])
            else:
                ds.logits = self.heads(state.hidden)[:, 0]  # [K, V]
        # Nodes at the deepest level may be in the range without needing children; clamp their rows.
        depths = [min(d, ds.logits.shape[0] - 1) for d in tree.depth[start:end]]
        if len(set(depths)) == 1:
            return ds.logits[depths[0]].expand(end - start, -1)
        return ds.logits[torch.tensor(depths, device=ds.logits.device)]

    def _base(self, state, ds: _HeadState) -> torch.Tensor:
        """Hydra's base state at length-1: h itself, or the prefix layer fed every new committed position."""
        if not self.has_prefix:
            return state.hidden
        L = state.length
        if ds.fed < L:
            fresh = state.fresh_hidden
            n = L - ds.fed
            if fresh is None or fresh.shape[0] < n:
                raise RuntimeError(f"prefix layer needs hidden states of positions {ds.fed}..{L - 1}, "
                                   f"the decoder kept {0 if fresh is None else fresh.shape[0]}")
            rows = fresh[-n:].to(self._dtype())
            if ds.kv is not None:
                out = self._fast.prefix_step(ds.kv, rows, ds.fed)
            else:
                out, ds.past = self.heads.base_step(rows, ds.fed, ds.past)
            ds.base, ds.fed = out[-1:], L
        return ds.base

    def _dtype(self):
        return next(self.heads.parameters()).dtype

    def _project(self, states: torch.Tensor) -> torch.Tensor:
        """Head states [n, d] -> draft logits [n, V] in target-id space. A pruned head projects onto its
        kept rows only and puts the dtype's minimum at every other id: q is exactly 0 there (lossless)."""
        dh = getattr(self.heads, "draft_head", None)
        if dh is None:
            return engine.project(self.heads.lm_head, states)
        return dh.to_target(engine.project(dh, states))

    def _path_logits(self, state, ds: _HeadState, tree: DraftTree, start: int, end: int) -> torch.Tensor:
        """Hydra: node i's children come from head depth(i)+1 reading the root and the drafted tokens
        above it; nodes are batched by depth (one head, one LM-head product per depth)."""
        base = self._base(state, ds)
        dev = tree.tok.device
        by_depth: dict[int, list[int]] = {}
        for i in range(start, end):
            by_depth.setdefault(tree.depth[i], []).append(i)
        rows: list[torch.Tensor] = [None] * (end - start)  # type: ignore[list-item]
        for d, nodes in by_depth.items():
            paths = torch.stack([tree.tok[torch.tensor(tree.path(i), device=dev)] for i in nodes])
            if ds.fast:
                states, logits = self._fast.depth_logits(base, paths)
            else:
                states = self.heads.draft_states(base, paths)
                logits = self._project(states)
            ds.hidden = states
            for j, i in enumerate(nodes):
                rows[i - start] = logits[j]
        return torch.stack(rows)

    def commit(self, dec, state, tree, path) -> None:
        state.drafter_state.logits = None

    def batch_adapter(self) -> "HeadRows":
        """Batched drafting for `draftsmith.engine.batched.BatchedSpeculativeDecoder`."""
        return HeadRows(self)


class HeadRows:
    """Batched drafting for a `HeadDrafter` (heads on the target's last hidden state)."""

    def __init__(self, drafter: HeadDrafter):
        self.drafter = drafter
        self.heads = drafter.heads

    def start(self, dec, states: list, capacity: int, rows: int) -> None:
        for s in states:
            self.join(dec, s)

    def join(self, dec, state) -> None:
        state.drafter_state = self.drafter.start(dec, state)

    @torch.no_grad()
    def begin_step(self, states: list) -> None:
        """Medusa: every row's K head logits in one call (rows without a hidden state get none)."""
        if self.drafter.reads_path:
            return
        live = [s for s in states if s.hidden is not None and s.draft_depth]
        if not live:
            return
        n = max(s.draft_depth for s in live)
        h = torch.cat([s.hidden for s in live])  # [b, d]
        shared = getattr(self.heads, "proj", "absent") is None and getattr(self.heads, "lm_head", None) is not None
        if shared:  # the target's LM head: one product for every row and every head the drafts read
            st = self.heads.head_states(h)[:n]  # [n, b, d]
            lg = self.drafter._project(st.reshape(-1, st.shape[-1])).reshape(n, len(live), -1)
        else:
            lg = self.heads(h)  # [K, b, V]
        for j, s in enumerate(live):
            s.drafter_state.logits = lg[:, j]

    @torch.no_grad()
    def propose(self, rows: list[int], states: list, trees: list[DraftTree],
                ranges: list[tuple[int, int]]) -> list[torch.Tensor | None]:
        if not self.drafter.reads_path:  # Medusa: the per-row adapter only indexes this step's head logits
            return [self.drafter.propose(None, s, t, a, b) for s, t, (a, b) in zip(states, trees, ranges)]
        # Hydra: group (row, node) by depth; one head and one LM-head product per depth across rows
        out: list[torch.Tensor | None] = [None] * len(states)
        by_depth: dict[int, list[tuple[int, int]]] = {}
        bases: dict[int, torch.Tensor] = {}
        for j, (s, t, (a, b)) in enumerate(zip(states, trees, ranges)):
            if s.hidden is None:
                continue
            self._unread(s)
            bases[j] = self.drafter._base(s, s.drafter_state)
            for i in range(a, b):
                by_depth.setdefault(t.depth[i], []).append((j, i))
        rows_out: dict[tuple[int, int], torch.Tensor] = {}
        for d, items in by_depth.items():
            paths = torch.stack([trees[j].tok[torch.tensor(trees[j].path(i), device=trees[j].tok.device)]
                                 for j, i in items])
            base = torch.cat([bases[j] for j, _ in items])
            logits = self.drafter._project(self.heads.draft_states(base, paths))
            for r, key in enumerate(items):
                rows_out[key] = logits[r]
        for j, (a, b) in enumerate(ranges):
            if j in bases:
                out[j] = torch.stack([rows_out[(j, i)] for i in range(a, b)])
        return out

    def commit(self, row: int, dec, state, tree: DraftTree, path: list[int]) -> None:
        self.drafter.commit(dec, state, tree, path)

    def history(self, state, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """The target's hidden states the drafter has yet to read, ending at length-1: a prefix layer
        (Hydra++) reads every committed position, including those of steps that drafted nothing (K = 0).
        Those are kept as one chunk per step and joined only when the drafter next reads them
        (`_unread`): a K = 0 step costs a list append, not a copy of every position still unread."""
        if not self.drafter.has_prefix or old is None:
            return new
        ds = state.drafter_state
        if state.length - ds.fed <= new.shape[0]:
            ds.pending = None
            return new
        if ds.pending is None:
            ds.pending = [old]
        ds.pending.append(new)
        return new

    @staticmethod
    def _unread(state) -> None:
        """Join the chunks `history` kept into the row's fresh hidden states (positions fed..length-1)."""
        ds = state.drafter_state
        if ds.pending:
            state.fresh_hidden = torch.cat(ds.pending)[-(state.length - ds.fed):]
            ds.pending = None

    def move_row(self, src: int, dst: int, src_state) -> None:
        pass  # per-row state lives in the row's DecodeState
