"""Drafter adapters for the batched decoder: one drafter call serves every live row.

The batched decoder (`batched.BatchedSpeculativeDecoder`) keeps one
`decoder.DecodeState` per row and asks an adapter for the children's logits
of a node range in several rows' trees at once (``propose(rows, states,
trees, ranges)``, one range per row). Each adapter reuses the
single-sequence drafter's own logic wherever it is per row:

* `HeadRows` (`drafters.HeadDrafter`: Medusa, Hydra, Hydra++): Medusa's K
  heads run once on the stacked hidden states of every row; path-reading
  heads (Hydra) get one call per depth over the stacked bases and paths of
  every row; a prefix layer (Hydra++) advances per row through the drafter's
  own ``_base`` (its keys and values are per row).
* `ModelRows` (`drafters.ModelDrafter`): the drafter model's own
  `ragged.RowsCache`, one row per live sequence; a step's first call feeds
  every row's unseen committed tokens and its root (ragged widths, padded to
  the widest), later calls feed tree nodes at slot L + index with position
  L + depth, exactly like the single-sequence adapter, and commit compacts
  the accepted fed nodes per row.

``rows`` are the cache rows (the rows' positions in the live batch); when a
row ends the decoder moves the last live row into its hole (``move_row``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.engine.drafters import HeadDrafter, ModelDrafter, project
from draftsmith.engine.ragged import RowsCache, ragged_forward
from draftsmith.engine.trees import DraftTree


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


@dataclass
class _RowModel:
    valid: int = 0  # slots [0, valid) of this row hold the drafter's KV of state.tokens[:valid]
    fed_end: int = 0  # tree nodes [0, fed_end) were fed this step (at slots L + index)


class ModelRows:
    """Batched drafting for a `ModelDrafter` (a causal LM with its own cache, one row per sequence)."""

    def __init__(self, drafter: ModelDrafter):
        self.drafter = drafter
        self.cache: RowsCache | None = None

    def start(self, dec, states: list, capacity: int, rows: int) -> None:
        """``rows``: the most rows live at once (continuous batching admits rows up to it)."""
        m = self.drafter.model
        if self.cache is None or self.cache.capacity < capacity or self.cache.n_rows < rows:
            self.cache = RowsCache.for_model(m, max(rows, 1), capacity)
        for s in states:
            self.join(dec, s)

    def join(self, dec, state) -> None:
        state.drafter_state = _RowModel()  # its prompt is fed with its first proposal (catch-up), no prefill

    def begin_step(self, states: list) -> None:
        pass

    @torch.no_grad()
    def propose(self, rows: list[int], states: list, trees: list[DraftTree],
                ranges: list[tuple[int, int]]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(states)
        first = [j for j, (a, _) in enumerate(ranges) if a == 0]
        later = [j for j, (a, _) in enumerate(ranges) if a > 0]
        if first:
            for j, h in zip(first, self._catch_up([rows[j] for j in first], [states[j] for j in first])):
                out[j] = h
        if later:
            hs = self._nodes([rows[j] for j in later], [states[j] for j in later], [trees[j] for j in later],
                             [ranges[j] for j in later])
            for j, h in zip(later, hs):
                out[j] = h
        for j, (a, b) in enumerate(ranges):
            ds = states[j].drafter_state
            ds.fed_end = b if a == 0 else max(ds.fed_end, b)
        return out

    def _catch_up(self, rows: list[int], states: list) -> list[torch.Tensor]:
        """Feed every row's committed tokens the drafter has not seen, then its root (slot L)."""
        dev = self.cache.rows.device
        widths = [s.length + 1 - s.drafter_state.valid for s in states]
        w = max(widths)
        ids = torch.zeros((len(states), w), dtype=torch.long)
        for i, s in enumerate(states):
            ids[i, :widths[i]] = torch.tensor(s.tokens[s.drafter_state.valid:s.length + 1])
        valid = torch.tensor([s.drafter_state.valid for s in states], device=dev)
        pos = valid[:, None] + torch.arange(w, device=dev)[None]
        causal = torch.ones(w, w, dtype=torch.bool, device=dev).tril().expand(len(states), w, w)
        h = ragged_forward(self.drafter.body, self.cache, ids.to(dev), valid, pos, valid, causal, valid, rows)
        last = h[torch.arange(len(states), device=dev), torch.tensor(widths, device=dev) - 1]
        return [x[None] for x in project(self.drafter.head, last)]  # [1, V] per row: the root's children

    def _nodes(self, rows: list[int], states: list, trees: list[DraftTree],
               ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Feed tree nodes [a, b) of each row at slots L + index, position L + depth, ancestors visible."""
        dev = self.cache.rows.device
        n = len(states)
        counts = [b - a for a, b in ranges]
        m = max(counts)
        kb = max(a + m for a, _ in ranges)
        ids = torch.zeros((n, m), dtype=torch.long, device=dev)
        depth = torch.zeros((n, m), dtype=torch.long)
        block = torch.zeros((n, m, kb), dtype=torch.bool)
        for i, (t, (a, b)) in enumerate(zip(trees, ranges)):
            ids[i, :b - a] = t.tok[a:b]
            depth[i, :b - a] = torch.tensor(t.depth[a:b])
            block[i, :b - a, :b] = t.ancestor_mask("cpu")[a:b, :b]
            for j in range(b - a, m):  # padding sees itself only
                block[i, j, a + j] = True
        L = torch.tensor([s.length for s in states], device=dev)
        start = torch.tensor([a for a, _ in ranges], device=dev)
        h = ragged_forward(self.drafter.body, self.cache, ids, L + start, L[:, None] + depth.to(dev), L,
                           block.to(dev), L, rows)
        keep = torch.cat([torch.arange(c, device=dev) + i * m for i, c in enumerate(counts)])
        lg = project(self.drafter.head, h.reshape(n * m, -1)[keep])
        return list(torch.split(lg, counts))

    def history(self, state, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new

    def commit(self, row: int, dec, state, tree: DraftTree, path: list[int]) -> None:
        ds: _RowModel = state.drafter_state
        if ds.fed_end == 0:
            return
        fed = [i for i in path if i < ds.fed_end]
        L = state.length
        self.cache.compact_row(row, [L + i for i in fed[1:]], L + 1)
        ds.valid = L + len(fed)
        ds.fed_end = 0

    def move_row(self, src: int, dst: int, src_state) -> None:
        self.cache.move_row(src, dst, src_state.drafter_state.valid)


_ADAPTERS: dict[type, type] = {HeadDrafter: HeadRows, ModelDrafter: ModelRows}


def batch_adapter(drafter):
    """The batched adapter of a decoder drafter: its own ``batch_adapter()`` (a kind's drafter that
    brings one), else the engine's adapter of its family; a clear error for drafters not batched yet."""
    own = getattr(drafter, "batch_adapter", None)
    if callable(own):
        return own()
    for cls in type(drafter).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls](drafter)
    raise ValueError(f"batched decoding supports head drafters (Medusa, Hydra, Hydra++) and standalone model "
                     f"drafters; {getattr(drafter, 'name', type(drafter).__name__)!r} "
                     f"({type(drafter).__name__}) is not batched yet: use SpeculativeDecoder (batch size 1)")
