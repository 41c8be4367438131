"""Batched lossless speculative decoding with ragged acceptance (BASS-style), and plain batched decoding.

B sequences decode together. Every step: each live row drafts (a chain of K
or a static tree; one drafter call per depth serves every row), one target
forward verifies every row's block, each row is verified on its own with its
own random source (`trees.verify_tree`, the single-sequence rule), and each
row commits its own number of accepted tokens. The KV cache
(`kvcache.KVCache`) is allocated once and indexed by absolute position per
row, so a row that accepted fewer tokens costs no padding later: the only
padding is within a step, up to the widest row's block (bounded by the
draft size, never growing with the step count). A row that ends (EOS or
``max_new_tokens``) leaves the batch at once: the last live row's entries
move into its hole, and no later forward computes it.

Each row follows exactly the single-sequence decoder's rules (state
convention, verification, EOS handling, per-row caps near
``max_new_tokens``), so greedy rows equal batch-1 decoding and, when
sampling, each row's output is distributed as the target's: a row's draws
come only from its own random source, and the draft length of a step
depends only on how many rows are live, never on this step's drafts.

Without a drafter (or with K = 0 chosen by the batch-aware policy, see
`batch_policy.BatchAwareLength`) a step is plain batched decoding on the
same cache: our baseline.

Choices, documented here once:
  * the prompt minus its last token is prefilled row by row (no padding:
    on a compute-bound CPU a padded prefill costs rows x longest prompt);
    prefill forwards are not decoding forwards (metrics.py);
  * an empty batch, an empty prompt, ``max_new_tokens < 0`` or a prompt
    that with its new tokens and a draft block exceeds the context: ValueError
    naming the row;
  * drafters: any whose kind brings a batched adapter (``batch_adapter()``:
    the heads' `HeadRows`, the standalone drafters' `ModelRows`, EAGLE-3's;
    `capabilities.batch_adapter`); chains and static
    trees; model-free drafters (``draft_tree``, e.g. SuffixDecoding) build
    each row's tree themselves; dynamic trees and self-drafters (Kangaroo)
    are refused with a clear error (single-sequence decoder only for now);
  * acceptance "exact" only (the lossy typical rule is not offered here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from draftsmith.chat import shared_len
from draftsmith.engine.batch_policy import BatchAwareLength, GoodputTable, calibrate, expected_tokens
from draftsmith.engine.capabilities import batch_adapter, capabilities, check_drafter
from draftsmith.engine.decoder import DecodeState
from draftsmith.engine.drafters import project
from draftsmith.engine.fast_batch import batch_body
from draftsmith.engine.metrics import DecodeResult, StepStats, tau, tokens_per_second
from draftsmith.engine.kvcache import KVCache, sliding_windows
from draftsmith.engine.ragged import ragged_forward
from draftsmith.engine.sampling import RandomSource, SamplingParams, TorchRandom, WithoutReplacement, greedy_ids
from draftsmith.engine.trees import DraftTree, StaticTree, Verdict, verify_tree
from draftsmith.target import Target

__all__ = ["BatchedSpeculativeDecoder", "BatchResult", "BatchStep", "BatchAwareLength", "GoodputTable", "calibrate",
           "expected_tokens", "plain_batched_decoder"]


# on_step(row, new_ids, stats, stop_reason): see `BatchedSpeculativeDecoder.generate`
OnStep = Callable[[int, list[int], StepStats, "str | None"], None]


@dataclass
class NewRow:
    """A sequence that joins a running batch (continuous batching: `BatchedSpeculativeDecoder.generate`'s
    ``admit``): its prompt, budget, own random source and logits processing (or None)."""

    prompt: list[int]
    max_new_tokens: int
    rng: RandomSource
    processing: Any = None


# admit(free_rows) -> the rows that join before the next step (at most free_rows; [] for none)
Admit = Callable[[int], "list[NewRow]"]


@dataclass
class BatchStep:
    """One batched step: one target forward over every live row."""

    live: int  # rows in the forward
    k: int  # draft length chosen (chains; the tree's size for trees; 0 = plain)
    drafted: int  # draft tokens over all rows
    accepted: int  # accepted draft tokens over all rows
    emitted: int  # tokens emitted over all rows
    draft_s: float
    verify_s: float
    other_s: float


@dataclass
class BatchResult:
    """Output of one batched generation: per-row results (input order) and per-step statistics."""

    rows: list[DecodeResult]
    steps: list[BatchStep] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    @property
    def row_forwards(self) -> int:
        """Target forwards summed over rows (a row's step counts once for that row)."""
        return sum(s.live for s in self.steps)

    @property
    def tau(self) -> float:
        """Tokens per row-forward (metrics.tau over every row; plain decoding = 1.00)."""
        return tau(self.tokens, self.row_forwards)

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_second(self.tokens, self.wall_s)

    def summary(self) -> dict:
        return {"rows": len(self.rows), "tokens": self.tokens, "tau": self.tau, "steps": len(self.steps),
                "tokens_per_s": self.tokens_per_s, "wall_s": self.wall_s, "prefill_s": self.prefill_s,
                "k_chosen": sorted({s.k for s in self.steps})}


class BatchedSpeculativeDecoder:
    """Lossless speculative decoding of B sequences at once (see the module docstring).

    Args:
      target: the target model.
      drafter: a drafter with a batched adapter (``batch_adapter()``), or None for plain batched decoding.
      tree: None for chains, or a `StaticTree` / list of rank paths.
      k: chain draft length (an int >= 1) or a `BatchAwareLength` (K chosen per step from the live batch
        size; K = 0 is plain decoding). Ignored for trees and without a drafter.
      sampling: temperature / top-k / top-p, applied identically to draft and target, per row.
      draft_max_rows: draft only while at most this many rows are live; a step with more is plain (vLLM's
        ``disable_by_batch_size``: where a wide batch already keeps the CPU's multipliers busy, verifying drafts
        costs more than they bring). None: draft at every batch size. Like the length policy it depends on the
        number of live rows only, so every row's output stays the target's.
    """

    def __init__(self, target: Target, drafter: Any = None, *, tree: Any = None, k: int | BatchAwareLength = 4,
                 sampling: SamplingParams | None = None, draft_max_rows: int | None = None):
        if draft_max_rows is not None and (not isinstance(draft_max_rows, int) or draft_max_rows < 1):
            raise ValueError(f"draft_max_rows must be a positive integer or None, got {draft_max_rows!r}")
        self.draft_max_rows = draft_max_rows
        self.target, self.drafter = target, drafter
        self.sampling = sampling or SamplingParams()
        if tree is not None and not isinstance(tree, StaticTree):
            if not isinstance(tree, (list, tuple)):
                raise ValueError(f"batched decoding takes chains or static trees (lists of rank paths), "
                                 f"got {type(tree).__name__}")
            tree = StaticTree(tree)
        self.tree = tree
        if isinstance(k, BatchAwareLength):
            if tree is not None:
                raise ValueError("the batch-aware length policy chooses chain lengths; use it with tree=None")
            self.policy: BatchAwareLength | None = k
            self.k = k.max_len
        else:
            if int(k) < 1:
                raise ValueError(f"draft length k must be >= 1 (or a BatchAwareLength), got {k}")
            self.policy, self.k = None, int(k)
        self.model = target.model
        self.body = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.eos = frozenset(target.eos_token_ids)
        # prefills, plain steps and draft verification through the fused batched step (`fast_batch.FastBatchBody`,
        # the data engine's) when the target decodes with our forward (`fastpath.use_fast_forward` put one on it):
        # the same cache buffers; a drafter that reads the target's layers gets their outputs through its hooks
        fb = getattr(target, "fast_body", None)
        self.forward = "eager" if fb is None else "compile" if fb.compiled is not None else "fast"
        # a target with sliding windows (Gemma 3): the fused step's kernels attend over every live slot, which is
        # the windowed attention only while every position is inside the smallest window; a call whose cache holds
        # no more positions than that runs fused, a longer one the model's own forward (`_within_window`)
        windows = sliding_windows(self.model.config)
        self.window = min(windows.values()) if windows else None
        self.cache: KVCache | None = None
        self.prefix: list[int] = []  # a prefix many prompts start with (`set_prefix`), its entries once computed
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.prefix_stats = {"rows": 0, "tokens_reused": 0}
        self.adapter = None
        self._drafting = False  # set per generate() call
        self._procs: list[Any] | None = None  # per-row RequestProcessing, set per generate() call
        self.caps = capabilities(drafter)  # what the drafter can do, read and checked once
        # a model-free drafter (drafters/suffix) builds each row's tree itself (``draft_tree``)
        self.own_trees = self.caps.builds_trees
        if self.own_trees and (tree is not None or not self.caps.model_free):
            raise ValueError(f"drafter {self.caps.name!r} builds its own trees: "
                             "batched decoding takes it alone (model-free) and without tree=")
        if drafter is not None:
            check_drafter(self.caps, target, self.tree)
            self.adapter = batch_adapter(self.caps)

    @property
    def max_block(self) -> int:
        """Most entries one verification forward adds per row: the root plus the largest draft."""
        if self.drafter is None:
            return 1
        if self.own_trees:
            return 1 + self.caps.max_nodes
        return 1 + (self.tree.size if self.tree is not None else self.k)

    # ------------------------------------------------------------------ setup
    def set_prefix(self, tokens: Sequence[int]) -> None:
        """A token prefix that many prompts start with (a chat template's system prompt and user header): its
        cache entries are computed once, by the fused prefill of the prefix alone at the first prefill that can use
        them, and copied into each later row whose committed prompt starts with at least 2 of its tokens; that
        row's prefill then runs the rest of its prompt only (the data engine's shared prefix, kept across calls).
        Used with the fused step, without a drafter or with a model-free one (a drafter that reads the target's
        states reads the whole prompt's). The entries are the prefix prefilled alone: equal to those of a prefill
        of the whole prompt up to the products' summation order, as any two prefills of different lengths are.
        An empty prefix turns it off; setting the same prefix again keeps its entries."""
        tokens = [int(t) for t in tokens]
        if tokens != self.prefix:
            self.prefix, self._prefix_kv = tokens, None

    def _prefix_offset(self, st: DecodeState) -> int:
        """Slots of the prefix a row's prefill can take from it: its shared length with the row's committed
        tokens, leaving at least one token to prefill (0 below 2)."""
        off = shared_len(st.tokens, self.prefix, st.length - 1)
        return off if off >= 2 else 0

    def _rows(self, prompts, max_new_tokens) -> tuple[list[list[int]], list[int]]:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        prompts = [[int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in prompts]
        if not prompts:
            raise ValueError("empty batch: give at least one prompt")
        news = [int(max_new_tokens)] * len(prompts) if isinstance(max_new_tokens, int) else \
            [int(n) for n in max_new_tokens]
        if len(news) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(news)} max_new_tokens values")
        limits = [("target", self.target.context_length)]
        if self.caps.context_length:
            limits.append(("drafter", self.caps.context_length))
        for i, (p, n) in enumerate(zip(prompts, news)):
            if not p:
                raise ValueError(f"row {i}: empty prompt (the decoder needs at least one prompt token)")
            if n < 0:
                raise ValueError(f"row {i}: max_new_tokens must be >= 0, got {n}")
            need = len(p) + n + self.max_block
            for who, ctx in limits:
                if need > ctx:
                    raise ValueError(f"row {i}: prompt too long: {len(p)} prompt tokens + {n} new tokens + a draft "
                                     f"block of {self.max_block} = {need} positions exceed the {who}'s context "
                                     f"length {ctx}")
        return prompts, news

    def _fast(self, capacity: int | None = None):
        """The fused batched step (`fast_batch.FastBatchBody`: prefills, plain steps and verification), or None for
        an eager target (the model's own forward) and for a call whose cache (of ``capacity`` positions, default
        the current one's; with none yet, a windowed target's) reaches past the target's sliding window
        (`_within_window`)."""
        if capacity is None and self.cache is not None:
            capacity = self.cache.capacity
        within = self._within_window(capacity) if capacity is not None else self.window is None
        if self.forward == "eager" or not within:
            return None
        return batch_body(self.model, self.forward, within_window=self.window is not None)

    def _within_window(self, capacity: int) -> bool:
        """Whether a cache of ``capacity`` positions per row keeps every position inside the target's smallest
        sliding window (always, without windows): a query at position p sees a key at j when p - j < window, so
        below the window a sliding layer attends as a full one does, which the fused step computes."""
        return self.window is None or capacity <= self.window

    def _kv(self) -> list[torch.Tensor]:
        return [t for layer in self.cache.layers for t in (layer.keys, layer.values)]

    @torch.no_grad()
    def _prefill_rows(self, rows: list[int], states: list[DecodeState], prefilled) -> None:
        """Rows' committed prompt tokens into the target's cache: with the fused step, all in one flat forward
        (no padding; one per row for an adapter that reads the layers' hooks); else row by row through the model's
        own forward. ``prefilled(row, state)``, if given, runs after each row's."""
        fast = self._fast()
        todo = [(r, st) for r, st in zip(rows, states) if st.length > 0]
        if fast is not None and todo and prefilled is not None:
            # an adapter that reads the layers' hooks after each row's own prefill: one fused prefill per row
            for r, st in zip(rows, states):
                if st.length > 0:
                    h, _, _ = fast.prefill([st.tokens[:st.length]], [r], 0, self._kv(), hooks=True)
                    st.fresh_hidden, st.hidden, st.cached = h, h[-1:], st.length
                prefilled(r, st)
            return
        if fast is not None and todo:
            by_offset: dict[int, list[tuple[int, DecodeState]]] = {}
            share = self.prefix and (not self._drafting or self.caps.model_free)
            for r, st in todo:
                by_offset.setdefault(self._prefix_offset(st) if share else 0, []).append((r, st))
            for off, group in sorted(by_offset.items()):
                if off:
                    self._put_prefix([r for r, _ in group], off)
                h, _, starts = fast.prefill([st.tokens[:st.length] for _, st in group], [r for r, _ in group], off,
                                            self._kv())
                for i, (_, st) in enumerate(group):
                    st.fresh_hidden = h[starts[i]:starts[i + 1]]  # the prefilled part's states (after the prefix)
                    st.hidden, st.cached = st.fresh_hidden[-1:], st.length
            if prefilled is not None:
                for r, st in zip(rows, states):
                    prefilled(r, st)
            return
        for r, st in zip(rows, states):  # an adapter's ``prefilled`` reads the hooks of its row's own forward
            self._prefill(r, st)
            if prefilled is not None:
                prefilled(r, st)

    @torch.no_grad()
    def _put_prefix(self, rows: list[int], off: int) -> None:
        """The prefix's first ``off`` entries into ``rows`` (computed first, in the first of them, if not yet)."""
        if self._prefix_kv is None:
            pre = self.prefix[:self.cache.capacity]  # a row's offset stays below its length, so below the capacity
            self._fast().prefill([pre], [rows[0]], 0, self._kv())
            self._prefix_kv = self.cache.get_prefix(rows[0], len(pre))
        self.cache.put_prefix(torch.tensor(rows, device=self.device), self._prefix_kv, off)
        self.prefix_stats["rows"] += len(rows)
        self.prefix_stats["tokens_reused"] += off * len(rows)

    @torch.no_grad()
    def _prefill(self, row: int, st: DecodeState) -> None:
        """Row ``row``'s committed prompt tokens into the target's cache; sets its hidden states."""
        L = st.length
        if L == 0:
            return
        dev = self.device
        z = torch.zeros(1, dtype=torch.long, device=dev)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None]
        h = ragged_forward(self.body, self.cache, torch.tensor([st.tokens[:L]], device=dev), z,
                           torch.arange(L, device=dev)[None], z, causal, z, row)[0]
        st.hidden, st.fresh_hidden, st.cached = h[-1:], h, L

    # ------------------------------------------------------------------ drafting
    def _caps(self, states: list[DecodeState], depth: int) -> list[int]:
        md = self.caps.max_depth
        caps = []
        for s in states:
            c = s.max_new_tokens - s.emitted - 1  # the final token always takes one slot
            if md is not None:
                c = min(c, md)
            caps.append(max(0, min(c, depth)))
        return caps

    @staticmethod
    def _processed(procs, i: int, st: DecodeState, tree: DraftTree, start: int, end: int, lg: torch.Tensor):
        """Row i's draft logits after its request's processors (engine/processors.py), if any."""
        proc = procs[i] if procs is not None else None
        if proc is None or not proc.active or not proc.process_draft:
            return lg
        return proc.node_logits(st.tokens[:st.length + 1], st.prompt_len, tree, start, end, lg)

    def _draft_chains(self, states, trees, rngs, k: int, procs=None) -> None:
        caps = self._caps(states, k)
        ranked = self.sampling.greedy
        node = [0] * len(states)
        stopped = [c <= 0 for c in caps]
        for depth in range(k):
            act = [i for i in range(len(states)) if not stopped[i] and depth < caps[i]]
            if not act:
                return
            lgs = self.adapter.propose(act, [states[i] for i in act], [trees[i] for i in act],
                                       [(node[i], node[i] + 1) for i in act])
            have = [(i, self._processed(procs, i, states[i], trees[i], node[i], node[i] + 1, lg))
                    for i, lg in zip(act, lgs) if lg is not None]
            for i, lg in zip(act, lgs):
                if lg is None:
                    stopped[i] = True
            if not have:
                return
            if ranked:  # one argmax for every row, tokens stay on the device
                rows_ = [lg[0] for _, lg in have]
                if len({x.dtype for x in rows_}) > 1:  # processed rows are fp32, the others the model's dtype
                    rows_ = [x.float() for x in rows_]
                toks = greedy_ids(torch.stack(rows_))
                for (i, _), t in zip(have, toks):
                    node[i] = trees[i].add(node[i], t)
                continue
            for i, lg in have:
                s = self.sampling
                q = s.probs(lg[0])
                tok = rngs[i].categorical(q)
                trees[i].q[node[i]] = q
                node[i] = trees[i].add(node[i], tok)
                if tok in self.eos:
                    stopped[i] = True

    def _draft_static(self, states, trees, rngs, procs=None) -> None:
        """`drafting.grow_static` for every row at once: one drafter call per depth across rows."""
        shape = self.tree
        caps = self._caps(states, shape.depth)
        kids: dict[tuple[int, ...], int] = {}
        for p in shape.paths:
            kids[p[:-1]] = kids.get(p[:-1], 0) + 1
        where = [{(): 0} for _ in states]
        s = self.sampling
        for depth in range(1, shape.depth + 1):
            act, parents, rng_ = [], {}, []
            for i, t in enumerate(trees):
                if depth > caps[i]:
                    continue
                ps = sorted((where[i][pp], pp) for pp in kids if len(pp) == depth - 1 and pp in where[i])
                ps = [(n, pp) for n, pp in ps if n == 0 or t._host[n] is None or t._host[n] not in self.eos]
                if ps:
                    act.append(i)
                    parents[i] = ps
                    lo = min(n for n, d in enumerate(t.depth) if d == depth - 1)
                    hi = max(n for n, d in enumerate(t.depth) if d == depth - 1)
                    rng_.append((lo, hi + 1))
            if not act:
                return
            lgs = self.adapter.propose(act, [states[i] for i in act], [trees[i] for i in act], rng_)
            for i, lg, (lo, hi) in zip(act, lgs, rng_):
                if lg is None:
                    caps[i] = 0
                    continue
                t = trees[i]
                lg = self._processed(procs, i, states[i], t, lo, hi, lg)
                for n, pp in parents[i]:
                    row, m = lg[n - lo], min(kids[pp], lg.shape[-1])
                    if s.greedy:
                        for r, tok in enumerate(torch.topk(row, m).indices):
                            where[i][pp + (r,)] = t.add(n, tok)
                        continue
                    q = s.probs(row)
                    t.q[n] = q
                    draw = WithoutReplacement(q, rngs[i])
                    for r in range(m):
                        tok = draw.next()
                        if tok is None:
                            break
                        where[i][pp + (r,)] = t.add(n, tok)

    # ------------------------------------------------------------------ verification
    @torch.no_grad()
    def _verify_forward(self, states, trees) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One target forward over every row's block: per-row logits [n_r+1, V] and hidden [rows, m, d]."""
        dev = self.device
        n = len(states)
        counts = [t.n + 1 for t in trees]
        m = max(counts)
        L = torch.tensor([s.length for s in states], device=dev)
        fast = self._fast()
        if m == 1 and (fast is None or not (self._drafting and fast.hooked())):
            ids = torch.stack([t.tokens() for t in trees])
            if fast is not None:  # a plain step: one token per row, the fused step (no layer's hooks to call)
                h, lg = fast.step(ids[:, 0], L, self._kv())
                return list(lg[:, None]), h[:, None]
            block = torch.ones((n, 1, 1), dtype=torch.bool, device=dev)
            h = ragged_forward(self.body, self.cache, ids, L, L[:, None], L, block, L, 0)
            return list(project(self.lm_head, h[:, 0])[:, None]), h
        ids = torch.zeros((n, m), dtype=torch.long, device=dev)
        depth = torch.zeros((n, m), dtype=torch.long)
        block = torch.zeros((n, m, m), dtype=torch.bool)
        for i, t in enumerate(trees):
            c = counts[i]
            ids[i, :c] = t.tokens()
            depth[i, :c] = torch.tensor(t.depth)
            block[i, :c, :c] = t.ancestor_mask("cpu") if not t.is_chain() else torch.ones(c, c, dtype=torch.bool).tril()
            block[i, range(c, m), range(c, m)] = True  # padding sees itself only
        pos = L[:, None] + depth.to(dev)
        if fast is not None:
            # the fused step over every row's block, unpadded (the layers' hooks called for a drafter that reads them)
            h, lg = fast.verify(ids, pos, L, block.to(dev), counts, self._kv(), hooks=self._drafting)
            return list(torch.split(lg, counts)), h
        h = ragged_forward(self.body, self.cache, ids, L, pos, L, block.to(dev), L, 0)
        keep = torch.cat([torch.arange(c, device=dev) + i * m for i, c in enumerate(counts)])
        lg = project(self.lm_head, h.reshape(n * m, -1)[keep])
        return list(torch.split(lg, counts)), h

    def _commit(self, row: int, st: DecodeState, tree: DraftTree, verdict: Verdict, hidden: torch.Tensor) -> int:
        """`SpeculativeDecoder.commit` for one row of the batch; returns the tokens emitted."""
        L = st.length
        self.cache.compact_row(row, [L + i for i in verdict.path[1:]], L + 1)
        if self._drafting:
            self.adapter.commit(row, self, st, tree, verdict.path)
        path = torch.tensor(verdict.path, device=hidden.device)
        old = st.fresh_hidden
        st.hidden = hidden[verdict.path[-1]][None]
        st.fresh_hidden = hidden[path]
        out = list(verdict.tokens)
        hit = next((i for i, t in enumerate(out) if t in self.eos), None)
        if hit is not None:
            out = out[: hit + 1]
            st.done, st.stop_reason = True, "eos"
        if len(out) > st.max_new_tokens - st.emitted:  # cannot happen (drafts are capped), kept as a guard
            raise RuntimeError(f"row {row}: step emitted {len(out)} tokens past max_new_tokens")
        st.tokens.extend(out)
        st.length = st.cached = L + 1 + verdict.accepted
        if self._drafting:
            st.fresh_hidden = self.adapter.history(st, old, st.fresh_hidden)
        if not st.done and st.emitted >= st.max_new_tokens:
            st.done, st.stop_reason = True, "max_new_tokens"
        return len(out)

    # ------------------------------------------------------------------ whole generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 128, *,
                 seeds: Sequence[int] | None = None, rngs: Sequence[RandomSource] | None = None,
                 seed: int = 0, on_step: OnStep | None = None,
                 processing: Sequence[Any] | None = None, admit: Admit | None = None,
                 max_rows: int | None = None, capacity: int | None = None, release: bool = False) -> BatchResult:
        """Decode every prompt at once; each row has its own random source (``rngs``, else ``TorchRandom``
        seeded by ``seeds[i]``, else ``seed + i``). Rows come back in input order.

        ``on_step(row, new_ids, stats, stop_reason)``, if given, is called after every step for each row
        in it (``row``: the input index; ``new_ids``: the tokens the step committed; ``stop_reason``:
        None while the row goes on, else ``"eos"`` / ``"max_new_tokens"``, once, as the row leaves). It
        only observes (streaming, per-row logging): the outputs are the same with or without it, except that a
        true return value ends that row now (stop reason ``"stop"``: the caller found a stop sequence).

        ``processing``: per row, a `processors.RequestProcessing` (penalties, logit bias, logprobs) or None.

        Continuous batching: ``admit(free)``, if given, is called before every step while fewer than
        ``max_rows`` rows are live, and the `NewRow` s it returns join the batch at once (prefilled, then decoded
        with the others; row indices continue after the prompts'). The call returns when no row is live and
        ``admit`` gives none. Every row's prompt, new tokens and draft block must fit ``capacity`` positions (the
        cache is allocated once, for ``max_rows`` rows): ``admit`` should hold back what does not fit
        (`fits`); an admitted row that does not fit is a ValueError. Each row follows the same rules whether
        it started the call or joined it, so its output does not depend on when it joined.

        ``release``: a row's state, random source and processing are dropped as it leaves, and no step statistics
        are kept (a call that admits rows for hours holds only its live rows); the result's ``rows`` are then
        empty, and ``on_step`` is the only output."""
        prompts, news = self._rows(prompts, max_new_tokens)
        B = len(prompts)
        if processing is not None and len(processing) != B:
            raise ValueError(f"{B} prompts but {len(processing)} processing entries")
        self._procs = list(processing) if processing is not None else ([None] * B if admit is not None else None)
        if rngs is None:
            seeds = list(seeds) if seeds is not None else [seed + i for i in range(B)]
            rngs = [TorchRandom(s) for s in seeds]
        elif len(rngs) != B:
            raise ValueError(f"{B} prompts but {len(rngs)} random sources")
        rngs = list(rngs)
        t0 = time.perf_counter()
        states = [DecodeState(tokens=list(p), prompt_len=len(p), length=len(p) - 1, hidden=None, max_new_tokens=n)
                  for p, n in zip(prompts, news)]
        live = [i for i in range(B) if news[i] > 0]
        for i in range(B):
            if news[i] == 0:
                states[i].done, states[i].stop_reason = True, "max_new_tokens"
        need = max(self.positions(len(p), n) for p, n in zip(prompts, news))
        if capacity is not None and need > capacity:
            raise ValueError(f"the batch needs {need} cache positions per row; capacity is {capacity}")
        capacity = max(capacity or need, min(256, self.window or 256))
        rows_cap = max(max_rows or len(live), len(live), 1)
        reuse = self.cache is not None and self.cache.capacity >= capacity and self.cache.n_rows >= rows_cap and \
            self._within_window(self.cache.capacity) == self._within_window(capacity)
        if reuse:
            capacity = self.cache.capacity
        fast = self._fast(capacity)
        if not reuse or (fast is None and not self.cache.zeroed):
            # the fused step's native attention reads written slots only (as the data engine's): no need to zero the
            # buffers, and pages no row reaches are never touched; the model's own masked forward needs them zeroed
            self.cache = KVCache.for_model(self.model, capacity, rows=self.cache.n_rows if reuse else rows_cap,
                                           zeroed=fast is None or not fast.native)
        live_states = [states[i] for i in live]
        # Without admission, live rows only leave the batch, so when the length policy picks K = 0 for every
        # batch size up to this one the drafter can never run in this call: no drafter state is kept (plain
        # decoding's cost).
        self._drafting = self.adapter is not None and (
            self.tree is not None or any(self._k_for(m) > 0 for m in range(1, rows_cap + 1)))
        # an adapter that reads more of the target's prefill than its last hidden states (EAGLE-3: three layers'
        # outputs, caught by hooks) takes them right after each row's prefill forward
        prefilled = getattr(self.adapter, "prefilled", None) if self._drafting else None
        self._prefill_rows(list(range(len(live_states))), live_states, prefilled)
        if self._drafting:
            self.adapter.start(self, live_states, self.cache.capacity, rows_cap)
        t1 = time.perf_counter()
        batch = BatchResult(rows=[])
        row_steps: dict[int, list[StepStats]] = {i: [] for i in range(B)}
        while True:
            if admit is not None and len(live) < rows_cap:
                joined = [self._join(row, live, states, rngs, news, row_steps)
                          for row in admit(rows_cap - len(live))[:rows_cap - len(live)]]
                joined = [j for j in joined if j is not None]
                if joined:
                    self._prefill_rows([r for r, _ in joined], [st for _, st in joined], prefilled)
                    if self._drafting:
                        for _, st in joined:
                            self.adapter.join(self, st)
            if not live:
                break
            stepped = list(live)
            self._step(live, states, rngs, batch, row_steps, on_step)
            if release:
                batch.steps.clear()
                for i in stepped:
                    if states[i].done:
                        states[i] = rngs[i] = self._procs[i] = None
                        row_steps.pop(i)
        B = len(states)
        results = [None] * B
        finish = self.caps.finish if self._drafting and not release else None
        if finish is not None:  # e.g. a global suffix index learns from the finished responses, in row order
            for i in range(B):
                if news[i] > 0:
                    finish(self, states[i])
        t2 = time.perf_counter()
        if release:
            batch.prefill_s, batch.wall_s = t1 - t0, t2 - t0
            return batch
        for i in range(B):
            st = states[i]
            results[i] = DecodeResult(tokens=st.tokens[st.prompt_len:], prompt_len=st.prompt_len, steps=row_steps[i],
                                      prefill_s=(t1 - t0) / B, wall_s=t2 - t0,
                                      stop_reason=st.stop_reason or "max_new_tokens")
        batch.rows, batch.prefill_s, batch.wall_s = results, t1 - t0, t2 - t0
        return batch

    def warmup(self, prompt: Sequence[int], new_tokens: int, max_rows: int, capacity: int) -> list[int]:
        """Decode ``prompt`` (and twice it, rows of two lengths) in batches of each row count whose step compiles a
        graph of its own, up to ``max_rows`` (`FastBatchBody.graph_rows`), in a cache of ``max_rows`` rows, so that
        no request waits for a compile: ``capacity`` is the least a call allocates (a server's
        ``batch_positions``), the cache the one such a call gets (`call_capacity`). Returns the batch sizes run."""
        p = [int(t) for t in prompt]
        capacity = self.call_capacity(self.positions(2 * len(p), new_tokens), capacity)
        fast = self._fast(capacity)
        sizes = fast.graph_rows(max_rows) if fast is not None else [min(2, max_rows)]
        for n in sizes:
            self.generate([p if i % 2 == 0 else p + p for i in range(n)], new_tokens, max_rows=max_rows,
                          capacity=capacity)
        return sizes

    def call_capacity(self, need: int, floor: int) -> int:
        """Cache positions per row for a call whose rows need at most ``need``, allocating at least ``floor`` (a
        server's ``batch_positions``, so later rows can join): on a target with sliding windows no more than the
        smallest window while the rows fit in it, so that the call runs the fused step (`_within_window`); rows
        that need more than the call's capacity wait for a call of their own (`fits`)."""
        if self.window is not None and need <= self.window:
            floor = min(floor, self.window)
        return max(int(need), int(floor))

    def positions(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a row needs: its prompt, its new tokens and two draft blocks (the one being verified
        and the rejected tail it overwrites)."""
        return prompt_len + max_new_tokens + 2 * self.max_block + 2

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a row can join the running batch's cache (`generate`'s ``admit``)."""
        return self.cache is not None and self.positions(prompt_len, max_new_tokens) <= self.cache.capacity

    def _join(self, row: NewRow, live: list[int], states: list[DecodeState], rngs: list, news: list[int],
              row_steps: dict) -> tuple[int, DecodeState] | None:
        """A row admitted into the running batch: checked as `generate` checks its prompts and given the next free
        cache row; returns (cache row, state) for the caller to prefill, or None (nothing to decode)."""
        (prompt,), (n,) = self._rows([row.prompt], [row.max_new_tokens])
        if not self.fits(len(prompt), n):
            raise ValueError(f"an admitted row needs {self.positions(len(prompt), n)} cache positions; the running "
                             f"batch's cache has {self.cache.capacity}")
        i = len(states)
        st = DecodeState(tokens=list(prompt), prompt_len=len(prompt), length=len(prompt) - 1, hidden=None,
                         max_new_tokens=n)
        states.append(st)
        rngs.append(row.rng)
        news.append(n)
        self._procs.append(row.processing)
        row_steps[i] = []
        if n == 0:
            st.done, st.stop_reason = True, "max_new_tokens"
            return None
        live.append(i)
        return len(live) - 1, st

    def _k_for(self, n: int) -> int:
        """The chain's draft length for n live rows: the policy's choice, else the fixed K."""
        return self.policy.choose(n) if self.policy else self.k

    def _step(self, live: list[int], states: list[DecodeState], rngs, batch: BatchResult,
              row_steps: dict[int, list[StepStats]], on_step: OnStep | None = None) -> None:
        t0 = time.perf_counter()
        sts = [states[i] for i in live]
        rr = [rngs[i] for i in live]
        pp = [self._procs[i] for i in live] if self._procs is not None else None
        n = len(live)
        trees = [DraftTree(s.tokens[s.length], self.max_block - 1, self.device) for s in sts]
        k = 0
        if self._drafting and (self.draft_max_rows is None or n <= self.draft_max_rows):
            k = self.max_block - 1 if self.own_trees else self.tree.size if self.tree is not None else self._k_for(n)
        if k > 0:
            depth = self.tree.depth if self.tree is not None else k
            for s, c in zip(sts, self._caps(sts, depth)):
                s.draft_depth = c
            self.adapter.begin_step(sts)
            if self.own_trees:
                for s, t in zip(sts, trees):
                    cap = min(s.max_new_tokens - s.emitted - 1, t.capacity)
                    if cap > 0:
                        self.drafter.draft_tree(self, s, t, cap)
            elif self.tree is not None:
                self._draft_static(sts, trees, rr, pp)
            else:
                self._draft_chains(sts, trees, rr, k, pp)
        t1 = time.perf_counter()
        logits, hidden = self._verify_forward(sts, trees)
        if pp is not None:
            logits = [lg if p is None else p.node_logits(s.tokens[:s.length + 1], s.prompt_len, t, 0, t.n + 1, lg)
                      for p, s, t, lg in zip(pp, sts, trees, logits)]
        verdicts = [verify_tree(t, lg, self.sampling, r, self.eos, "exact") for t, lg, r in zip(trees, logits, rr)]
        if pp is not None:
            for p, t, lg, v in zip(pp, trees, logits, verdicts):
                if p is not None:
                    p.record(t, lg, v)
        t2 = time.perf_counter()
        keys = list(live)
        emitted = [self._commit(r, s, t, v, hidden[r]) for r, (s, t, v) in enumerate(zip(sts, trees, verdicts))]
        self._leave(live, states)
        t3 = time.perf_counter()
        dt = (t1 - t0, t2 - t1, t3 - t2)
        for key, t, v, e in zip(keys, trees, verdicts, emitted):
            row_steps[key].append(
                StepStats(emitted=e, accepted=v.accepted, attempted=v.attempted, drafted=t.n,
                          draft_s=dt[0] / n, verify_s=dt[1] / n, other_s=dt[2] / n))
        batch.steps.append(BatchStep(live=n, k=k, drafted=sum(t.n for t in trees),
                                     accepted=sum(v.accepted for v in verdicts), emitted=sum(emitted),
                                     draft_s=dt[0], verify_s=dt[1], other_s=dt[2]))
        if on_step is not None:
            stopped = False
            for key, e in zip(keys, emitted):
                st = states[key]
                was_done = st.done
                if on_step(key, st.tokens[len(st.tokens) - e:], row_steps[key][-1],
                           st.stop_reason if st.done else None) and not was_done:
                    st.done, st.stop_reason, stopped = True, "stop", True
            if stopped:
                self._leave(live, states)

    def _leave(self, live: list[int], states: list[DecodeState]) -> None:
        """Rows that ended leave the batch: the last live row moves into the hole (cache rows = live
        positions)."""
        for r in range(len(live) - 1, -1, -1):
            if states[live[r]].done:
                last = len(live) - 1
                if r != last:
                    self.cache.move_row(last, r, states[live[last]].length)
                    if self._drafting:
                        self.adapter.move_row(last, r, states[live[last]])
                    live[r] = live[last]
                live.pop()


def plain_batched_decoder(target: Target, sampling: SamplingParams | None = None) -> BatchedSpeculativeDecoder:
    """Plain batched decoding on the same ragged cache (the baseline)."""
    return BatchedSpeculativeDecoder(target, None, sampling=sampling)
