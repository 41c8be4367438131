"""The drafter interface and its implementations.

A drafter proposes the next-token logits for the children of tree nodes.
The decoder calls, per generation and per step:
  * ``start(dec, state) -> drafter state`` once per generation (prefill the
    drafter's own cache over ``state.tokens[:state.length]``). The target's
    prefill is fused into the first verification forward unless the drafter
    sets ``needs_target_hidden = True`` (then ``state.hidden``, the target's
    last hidden state at ``length - 1``, is ready before the first draft);
  * ``propose(dec, state, tree, start, end) -> logits [end - start, V] | None``
    for the contiguous node range [start, end) of this step's draft tree
    (node 0 is the root, the last emitted token; ``tree.parent``,
    ``tree.depth`` and ``tree.tok`` give every path); None means "cannot
    draft now" and the step falls back to plain decoding;
  * ``commit(dec, state, tree, path)`` after verification, before the
    decoder advances ``state.length``; ``path`` lists the accepted nodes.
Drafter state lives in ``state.drafter_state`` and is copied with
``copy.copy`` when a decode state is cloned.

Families:
  * `HeadDrafter`: heads on the target's last hidden state (Medusa). A head
    module that also reads the drafted tokens (Hydra) implements
    ``draft_states(base [1, d], paths [n, k+1]) -> [n, d]`` (head k+1) where
    each path is the root followed by the k drafted tokens above the new
    node, and ``base_step(rows, start, past)`` for its base state (Hydra++'s
    prefix layer reads every committed position's hidden state, from
    ``state.fresh_hidden``).
  * `ModelDrafter`: any causal LM over the target's vocabulary, with its own
    pre-allocated KV cache and tree attention (`first_layers_drafter` builds
    an untrained baseline from the target's first layers).
  * Self-drafters (Kangaroo) share the target's first layers: they get the
    decoder (its ``cache``, ``body``) in ``propose``, and may define
    ``verify_forward(dec, state, tree) -> (logits, hidden)`` to replace the
    decoder's full target forward (e.g. to reuse the shallow states).
Model-free drafters (suffix trees, prompt lookup) build the whole tree
themselves: ``draft_tree(dec, state, tree, cap) -> bool`` is called first
at every step with the room left (``cap`` drafted tokens at most); it adds
nodes with ``tree.add`` and puts every node whose children it proposed with
certainty in ``tree.certain`` (verified by `sampling.verify_node_certain`,
no q), and returns False to let the decoder grow the tree from ``propose``
as usual (a hybrid deferring to its trained drafter). ``max_nodes`` is the
largest tree it builds; ``finish(dec, state)`` is called after a
generation ends (a global index learning from finished responses).
Optional drafter attributes: ``default_policy`` (the chain length policy
when the decoder is given none), ``supports_trees = False`` (the decoder
then refuses a tree). A checkpoint's module that has
``decoder_drafter(target, fingerprint, name)`` builds its own drafter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.cpu_layout import WEIGHT_T, linear_rows, packed_weight
from draftsmith.engine.kvcache import SlotCache, prefix_block_mask
from draftsmith.engine.native import decode_linear, rows_linear_applies, rows_linear_on
from draftsmith.engine.trees import DraftTree
from draftsmith.target import Target


def project(head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` for [n, d] rows, with the fastest CPU kernel for few rows (same math).

    float32 on CPU (bf16 on a CPU without bf16 instructions), up to 8 rows:
    `draftsmith.engine.native.decode_linear` (on a 2-core AVX2 EPYC, 2 threads,
    49152 x 576: 4.0 ms for 1 row and 5.2 ms for 4, against 8.8 and 21.6 ms for F.linear). Otherwise,
    measured on this project's CPU (MKL, 1 thread, 49152 x 576 head): F.linear
    takes ~2x longer for 2-8 rows than the transposed product (19 vs 10 ms
    for 4 rows). With `draftsmith.engine.cpu_layout` the head also carries a
    contiguous transposed weight, and 1-3 rows use ``x @ W_t`` (7 vs 11.5 ms
    for one row).
    """
    w = getattr(head, "weight", None)
    if isinstance(head, torch.nn.Linear) and x.dim() == 2 and rows_linear_on() and rows_linear_applies(x, w):
        return decode_linear(x, w, head.bias)  # the native kernel, at about the memory's bandwidth
    if x.device.type == "cpu" and isinstance(head, torch.nn.Linear) and head.bias is None and x.dim() == 2:
        wt = getattr(head, WEIGHT_T, None)
        if wt is not None and x.shape[0] == 1 and wt.dtype == x.dtype:
            return x @ wt
        if x.shape[0] > 1 and packed_weight(head) is not None:
            return linear_rows(head, x)
        if wt is not None and x.shape[0] <= 3 and wt.dtype == x.dtype:
            return x @ wt
        if 1 < x.shape[0] <= 16:
            return (w @ x.T).T
    return head(x)


class Drafter(Protocol):
    """What the decoder needs from a drafter (see the module docstring)."""

    name: str
    max_depth: int | None  # deepest draft it can make (Medusa: its number of heads); None = any
    target_fingerprint: str | None  # the target it was made for; checked by the decoder

    def start(self, dec: Any, state: Any) -> Any: ...

    def propose(self, dec: Any, state: Any, tree: DraftTree, start: int, end: int) -> torch.Tensor | None: ...

    def commit(self, dec: Any, state: Any, tree: DraftTree, path: list[int]) -> None: ...


@runtime_checkable
class SelfDrafter(Protocol):
    """A drafter that drafts from the target's own shallow layers (Kangaroo, early exit): it can verify at full
    depth instead of reusing its shallow states, and stops its chain on a confidence threshold."""

    name: str
    default_policy: Any

    def variant(self, *, policy: Any = None, full_verify: bool | None = None, name: str | None = None) -> Any: ...

    def set_confidence(self, threshold: float) -> None: ...


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
            return project(self.heads.lm_head, states)
        return dh.to_target(project(dh, states))

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


@dataclass
class _ModelState:
    cache: SlotCache
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
        self._cache: SlotCache | None = None

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
            self._cache = SlotCache.for_model(self.model, dec.capacity)
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
        return project(self.head, torch.cat(rows) if len(rows) > 1 else rows[0])

    def commit(self, dec, state, tree, path) -> None:
        ds: _ModelState = state.drafter_state
        if ds.fed_end == 0:
            return
        fed = [i for i in path if i < ds.fed_end]
        L = state.length
        ds.cache.compact([L + i for i in fed[1:]], L + 1)
        ds.valid = L + len(fed)
        ds.fed_end = 0


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
