"""Decoding a standalone drafter, single and batched.

`ModelDrafter`: any causal LM over the target's vocabulary as a drafter, with its own pre-allocated KV cache
(`draftsmith.engine.kvcache.KVCache`). Tree node i of a step is fed at slot L + i with position L + depth(i),
and commit compacts the accepted nodes. `first_layers_drafter` builds the untrained ``first-layers:N`` baseline
from the target's first layers.

`ModelRows` is its batched adapter (``ModelDrafter.batch_adapter``): the drafter model's own
`draftsmith.engine.kvcache.KVCache`, one row per live sequence; a step's first call feeds every row's unseen
committed tokens and its root (ragged widths, padded to the widest), later calls feed tree nodes at slot L + index
with position L + depth, exactly like the single-sequence drafter, and commit compacts the accepted fed nodes per
row.

`StandaloneModelDrafter`: `ModelDrafter` with a target-space output head. Only the last product changes when the
vocabulary is pruned:
  * pruned: hidden -> the kept rows of the head (N products, not V) -> the
    kept logits at the kept ids and the dtype's minimum everywhere else, so
    q is exactly 0 off the kept set and the decoder verifies with the q it
    drew from (lossless, heads/vocab.py);
  * RDK: the kept-set distribution q' is redistributed by the sparse
    affinity map, q_RDK = M^T q' (drafters/rdk.py), and handed over as
    log q_RDK: the decoder's softmax of it is q_RDK itself at temperature 1
    (at other temperatures, q_RDK^(1/T) renormalised), the same vector for
    drawing and verifying, so any fixed M is lossless.
The drafter still reads every target id (full embeddings): a drafted pruned
id (RDK) is fed back like any other token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.engine import drafters as engine  # engine.project looked up per call (step_breakdown wraps it)
from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.policies import LengthPolicy
from draftsmith.engine.ragged import ragged_forward
from draftsmith.engine.trees import DraftTree
from draftsmith.registry import register_untrained
from draftsmith.target import Target


@dataclass
class _ModelState:
    cache: KVCache
    valid: int = 0  # slots [0, valid) hold this drafter's KV of state.tokens[:valid]
    fed_end: int = 0  # tree nodes [0, fed_end) were fed this step (at slots L + index)
    hidden: torch.Tensor | None = None  # last rows' hidden states (features for length policies)


class ModelDrafter:
    """A standalone causal LM drafter with its own pre-allocated KV cache.

    Tree node i of a step is fed at slot L + i with position L + depth(i)
    and attends to the committed prefix and its tree ancestors, exactly like
    the target's verification; after verification the accepted fed nodes
    are compacted like the target's cache.
    """

    def __init__(self, model: torch.nn.Module, target_fingerprint: str | None = None, name: str = "model",
                 max_depth: int | None = None):
        self.model = model.eval().requires_grad_(False)
        self.body = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.name = name
        self.target_fingerprint = target_fingerprint
        self.max_depth = max_depth
        self._cache: KVCache | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def _forward(self, ds: _ModelState, ids: torch.Tensor, pos: torch.Tensor, write: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
        ds.cache.set_write(write)
        h = self.body(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                      **cache_arg(self.body, ds.cache), use_cache=True).last_hidden_state[0]
        ds.hidden = h
        return h

    @torch.no_grad()
    def start(self, dec, state) -> _ModelState:
        if self._cache is None or self._cache.capacity < dec.capacity:
            self._cache = KVCache.for_model(self.model, dec.capacity)
        ds = _ModelState(self._cache)
        L = state.length
        if L > 0:
            dev = self._cache.layers[0].keys.device
            self._forward(ds, torch.tensor(state.tokens[:L], device=dev), torch.arange(L, device=dev), 0, None)
            ds.valid = L
        return ds

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor:
        ds: _ModelState = state.drafter_state
        L, dev = state.length, tree.tok.device
        dtype = ds.cache.layers[0].keys.dtype
        rows = []
        start_was_root = start == 0
        if start == 0:
            # Catch up: committed tokens this drafter has not seen, then the root (slot L).
            c = ds.valid
            ids = torch.tensor(state.tokens[c:L + 1], device=dev)
            n = L + 1 - c
            mask = None if n == 1 or c == 0 else prefix_block_mask(
                c, torch.ones(n, n, dtype=torch.bool, device=dev).tril(), dtype)
            rows.append(self._forward(ds, ids, torch.arange(c, L + 1, device=dev), c, mask)[-1:])
            start = 1
        if end > start:
            anc = tree.ancestor_mask(dev)[start:end, :end]
            pos = L + torch.tensor(tree.depth[start:end], device=dev)
            rows.append(self._forward(ds, tree.tok[start:end], pos, L + start, prefix_block_mask(L, anc, dtype)))
        # A step's first call always starts at the root, so it resets what this step fed.
        ds.fed_end = end if start_was_root else max(ds.fed_end, end)
        return engine.project(self.head, torch.cat(rows) if len(rows) > 1 else rows[0])

    def commit(self, dec, state, tree, path) -> None:
        ds: _ModelState = state.drafter_state
        if ds.fed_end == 0:
            return
        fed = [i for i in path if i < ds.fed_end]
        L = state.length
        ds.cache.compact([L + i for i in fed[1:]], L + 1)
        ds.valid = L + len(fed)
        ds.fed_end = 0

    def batch_adapter(self) -> "ModelRows":
        """Batched drafting for `draftsmith.engine.batched.BatchedSpeculativeDecoder`."""
        return ModelRows(self)


@register_untrained("first-layers", "the target's first N layers, its final norm and LM head as a standalone "
                    "drafter (untrained)", arg="N")
def first_layers_drafter(target: Target, n_layers: int) -> ModelDrafter:
    """An untrained baseline drafter: the target's first ``n_layers`` layers, final norm and output head."""
    cfg = copy.deepcopy(target.model.config)
    total = int(cfg.num_hidden_layers)
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in [1, {total}], got {n_layers}")
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    p = next(target.model.parameters())
    small = type(target.model)(cfg).to(device=p.device, dtype=p.dtype)
    keep = {k: v for k, v in target.model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
    missing, unexpected = small.load_state_dict(keep, strict=False)
    bad = [k for k in missing if k != "lm_head.weight"] + list(unexpected)
    if bad:
        raise RuntimeError(f"could not copy the target's first layers: {bad[:5]}")
    if "lm_head.weight" in missing:
        small.tie_weights()
    small.generation_config = copy.deepcopy(target.model.generation_config)
    return ModelDrafter(small, target_fingerprint=target.fingerprint, name=f"first-{n_layers}-layers")


@dataclass
class _RowModel:
    valid: int = 0  # slots [0, valid) of this row hold the drafter's KV of state.tokens[:valid]
    fed_end: int = 0  # tree nodes [0, fed_end) were fed this step (at slots L + index)


class ModelRows:
    """Batched drafting for a `ModelDrafter` (a causal LM with its own cache, one row per sequence)."""

    def __init__(self, drafter: ModelDrafter):
        self.drafter = drafter
        self.cache: KVCache | None = None

    def start(self, dec, states: list, capacity: int, rows: int) -> None:
        """``rows``: the most rows live at once (continuous batching admits rows up to it)."""
        m = self.drafter.model
        if self.cache is None or self.cache.capacity < capacity or self.cache.n_rows < rows:
            self.cache = KVCache.for_model(m, capacity, rows=max(rows, 1))
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
        return [x[None] for x in engine.project(self.drafter.head, last)]  # [1, V] per row: the root's children

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
        lg = engine.project(self.drafter.head, h.reshape(n * m, -1)[keep])
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



class TargetSpaceHead(nn.Module):
    """Hidden states -> logits over every target id from a pruned head (and an optional RDK map)."""

    def __init__(self, draft_head: nn.Module, rdk: nn.Module | None = None):
        super().__init__()
        self.draft_head, self.rdk = draft_head, rdk

    @property
    def vocab_size(self) -> int:
        return int(self.draft_head.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kept = engine.project(self.draft_head, h)
        return self.draft_head.to_target(kept) if self.rdk is None else self.rdk.logits(kept)


class StandaloneModelDrafter(ModelDrafter):
    """`ModelDrafter` over a standalone drafter's model, with its pruned head / RDK map when it has them."""

    def __init__(self, model: nn.Module, *, draft_head: nn.Module | None = None, rdk: nn.Module | None = None,
                 target_fingerprint: str | None = None, name: str = "standalone", max_depth: int | None = None,
                 policy: LengthPolicy | None = None):
        super().__init__(model, target_fingerprint=target_fingerprint, name=name, max_depth=max_depth)
        if draft_head is not None:
            self.head = TargetSpaceHead(draft_head.eval(), None if rdk is None else rdk.eval())
        elif rdk is not None:
            raise ValueError("an RDK map needs a pruned head")
        if policy is not None:
            self.default_policy = policy

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size if isinstance(self.head, TargetSpaceHead) else int(self.head.weight.shape[0])
