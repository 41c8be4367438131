"""Model-free decoder-side drafters: SuffixDecoding, prompt lookup, and the hybrid with a trained drafter.

They build each step's tree themselves (the decoder's ``draft_tree`` hook,
engine/drafters.py) from deterministic candidates, put every node with
children in ``tree.certain`` and so are verified by "accept iff the
target's own sample equals the candidate" (lossless, see
`draftsmith.engine.sampling.verify_node_certain`); no logits, no q.

* `SuffixDrafter`: a per-request `TokenIndex` over the prompt and the tokens
  generated so far, and a global `SuffixIndex` over earlier responses (fed by
  ``finish`` after each generation); the higher-scoring draft of the two.
* `PromptLookupDrafter`: the k tokens after the newest earlier occurrence of
  the context's last n-gram (the simplest member, HF's prompt lookup).
* `HybridDrafter`: per step, the suffix draft when its score (expected
  accepted tokens under the counts) is at least the trained drafter's
  running mean of accepted tokens per step, else the trained drafter's own
  draft. The choice depends only on the history, never on this step's
  verification, so the hybrid is as lossless as its two members.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.drafters.suffix.index import Draft, SuffixConfig, SuffixIndex, TokenIndex
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.tree_build import measure_step_cost
from draftsmith.registry import register_untrained


@dataclass
class _LocalState:
    local: TokenIndex
    fed: int = 0  # state.tokens[:fed] are in ``local``
    last_nodes: list = field(default_factory=list)  # (tree node, its parent, count probability) of this step's draft

    def __copy__(self) -> "_LocalState":
        # a cloned decode state may commit other tokens: it gets its own per-request index
        ix = TokenIndex(self.local.config)
        ix.toks, ix.link1, ix.link3 = array_copy(self.local.toks), array_copy(self.local.link1), array_copy(
            self.local.link3)
        ix.head1, ix.head3, ix.base = dict(self.local.head1), dict(self.local.head3), self.local.base
        return _LocalState(ix, self.fed, list(self.last_nodes))


def array_copy(a):
    return a[:]  # array slicing copies


def _feed(ls: _LocalState, state) -> list[int]:
    """Index the committed tokens and the root (emitted, uncached) not yet in the local index; the context."""
    end = state.length + 1
    if ls.fed < end:
        ls.local.extend(state.tokens[ls.fed:end])
        ls.fed = end
    return state.tokens[:end]


def add_draft(tree, d: Draft, eos: frozenset, where: dict | None = None) -> int:
    """Put a draft into the decoder's tree as certain candidates; nodes under a drafted EOS are dropped
    (nothing after an accepted EOS is emitted). Returns the nodes added; ``where`` (optional) receives each
    placed draft node's tree node (-1: the root, 0)."""
    where = {} if where is None else where
    where[-1] = 0
    dead = set()
    for i, (tok, par) in enumerate(zip(d.tokens, d.parents)):
        if par in dead:
            dead.add(i)
            continue
        parent = where[par]
        where[i] = tree.add(parent, int(tok))
        tree.certain.add(parent)
        if tok in eos:
            dead.add(i)
    return tree.n


# draft sizes (nodes) whose verification cost a cost-aware SuffixDrafter measures; the others are interpolated
COST_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)


def interpolate_costs(measured: dict[int, float], n_max: int) -> list[float]:
    """[a step's cost verifying n drafted nodes, for n = 0 .. n_max], relative to a plain step (1.0 at 0 nodes),
    from ``measured`` {nodes: cost}: linear between measured sizes, the last slope past the largest, and never
    decreasing with n (a noisy measurement must not make a larger draft look cheaper)."""
    pts = sorted({0: 1.0, **{int(k): float(v) for k, v in measured.items() if int(k) > 0}}.items())
    if len(pts) < 2:
        raise ValueError("interpolate_costs needs the cost of at least one draft size")
    out = []
    for n in range(n_max + 1):
        j = next((i for i, (x, _) in enumerate(pts) if x >= n), len(pts) - 1)
        j = max(j, 1)
        (x0, y0), (x1, y1) = pts[j - 1], pts[j]
        out.append(y0 + (y1 - y0) * (n - x0) / (x1 - x0))
    for n in range(1, len(out)):
        out[n] = max(out[n], out[n - 1])
    return out


def conditionals(d: Draft) -> list[float]:
    """Each node's probability given its parent (its path probability over its parent's)."""
    return [p / d.probs[par] if par >= 0 and d.probs[par] > 0 else p for p, par in zip(d.probs, d.parents)]


class Calibration:
    """What a count probability is worth: per bin of the conditional probability the counts give a node, the
    accepted nodes against the sum of the probabilities of the nodes tested (those whose parent was accepted),
    both started at ``prior`` pseudo-nodes of the bin's centre, so that before any step a probability is taken at
    its word. Counts from one or two occurrences promise 1.0; on sampled text a node's acceptance is the
    target's probability of it, which the bins learn."""

    def __init__(self, bins: int = 5, prior: float = 4.0):
        self.bins, self.prior = bins, prior
        self.hits, self.expected, self.tried = [0.0] * bins, [0.0] * bins, [0] * bins

    def _bin(self, c: float) -> int:
        return min(int(c * self.bins), self.bins - 1)

    def ratio(self, c: float) -> float:
        b = self._bin(c)
        centre = (b + 0.5) / self.bins
        return (self.hits[b] + self.prior * centre) / (self.expected[b] + self.prior * centre)

    def __call__(self, c: float) -> float:
        return min(1.0, c * self.ratio(c))

    def record(self, c: float, accepted: bool) -> None:
        b = self._bin(c)
        self.hits[b] += float(accepted)
        self.expected[b] += c
        self.tried[b] += 1

    def report(self) -> dict:
        return {"bins": [f"{i / self.bins:.1f}-{(i + 1) / self.bins:.1f}" for i in range(self.bins)],
                "tested": list(self.tried), "ratio": [round(self.ratio((i + 0.5) / self.bins), 3)
                                                      for i in range(self.bins)]}


def calibrated(d: Draft, cal: Calibration | None) -> Draft:
    """``d`` with its path probabilities recomputed from calibrated conditionals, best-first again (a child is
    never more probable than its parent, and the sort is stable, so parents still come first)."""
    if cal is None or not len(d):
        return d
    cond = conditionals(d)
    q: list[float] = []
    for c, par in zip(cond, d.parents):
        q.append(cal(c) * (q[par] if par >= 0 else 1.0))
    order = sorted(range(len(d)), key=lambda i: -q[i])
    new = {-1: -1, **{old: i for i, old in enumerate(order)}}
    return Draft(tokens=[d.tokens[i] for i in order], parents=[new[d.parents[i]] for i in order],
                 probs=[q[i] for i in order], score=sum(q), match_len=d.match_len,
                 counts_probs=[d.probs[i] for i in order])


def cost_cut(d: Draft, step_cost: list[float]) -> tuple[float, Draft]:
    """The prefix of best-first draft ``d`` with the most expected tokens per unit of step time, and that value:
    (1 + its score) / step_cost[its nodes], against a plain step's 1 / 1. A prefix of a best-first draft is a
    tree (parents come first), and the k most probable nodes are the k-node subtree with the highest score (a
    child is never more probable than its parent), so the best prefix is the best draft of any size."""
    best_k, best_v, s = 0, 1.0, 0.0
    for k, p in enumerate(d.probs[:len(step_cost) - 1], 1):
        s += p
        v = (1.0 + s) / step_cost[k]
        if v > best_v:
            best_k, best_v = k, v
    if best_k == len(d):
        return best_v, d
    return best_v, Draft(tokens=d.tokens[:best_k], parents=d.parents[:best_k], probs=d.probs[:best_k],
                         score=sum(d.probs[:best_k]), match_len=d.match_len if best_k else 0,
                         counts_probs=None if d.counts_probs is None else d.counts_probs[:best_k])


class SuffixDrafter:
    """SuffixDecoding: per-request and global suffix indexes (drafters/suffix/index.py).

    With ``config.cost_aware``, each draft is cut to its prefix with the most expected tokens per unit of step
    time (`cost_cut`): the verification costs by draft size are measured on the target once (`calibrate`, at
    the first generation; from one sequence's forward), and the counts' probabilities are calibrated by what
    verification accepted so far (`Calibration`); the scores (the gate's, the hybrid's) are then calibrated
    expected tokens. Both read only the history: as lossless as the drafts themselves."""

    model_free = True
    target_fingerprint = None  # token ids only: any target (the caller keeps one tokenizer per index)
    max_depth = None
    supports_trees = True

    def __init__(self, config: SuffixConfig | None = None, index: SuffixIndex | None = None, *,
                 name: str = "suffix", learn: bool = True):
        self.config = config or (index.config if index is not None else SuffixConfig())
        self.index = index if index is not None else SuffixIndex(self.config)
        self.name = name
        self.learn = learn  # finish() adds each finished response to the global index
        self.max_nodes = self.config.max_spec_tokens
        self.lookup_s = 0.0  # time spent in lookups (both indexes), for reports
        self.lookups = 0
        self.step_cost: list[float] | None = None  # nodes -> a step's time over a plain step's (cost_aware)
        self.calibration = Calibration()

    def calibrate(self, target, repeats: int = 5) -> list[float]:
        """Measure what verifying each draft size costs on ``target`` (its decoding forward, one sequence,
        `draftsmith.engine.tree_build.measure_step_cost`) and keep it as ``step_cost``."""
        n = self.config.max_spec_tokens
        sizes = sorted({s for s in COST_SIZES if s <= n} | {n})
        rel = measure_step_cost(target, sizes, repeats=repeats)
        self.step_cost = interpolate_costs({int(k): v for k, v in rel.items()}, n)
        return self.step_cost

    def start(self, dec, state) -> _LocalState:
        if self.config.cost_aware and self.step_cost is None:
            self.calibrate(dec.target)
        return _LocalState(TokenIndex(self.config))

    def speculate(self, ls: _LocalState, state, cap: int) -> Draft:
        t0 = time.perf_counter()
        ctx = _feed(ls, state)
        a = ls.local.speculate(ctx, cap)
        b = self.index.speculate(ctx, cap)
        self.lookup_s += time.perf_counter() - t0
        self.lookups += 1
        if self.step_cost is not None:
            (va, a), (vb, b) = (cost_cut(calibrated(x, self.calibration), self.step_cost) for x in (a, b))
            best = b if vb > va else a
        else:
            best = b if b.score > a.score else a
        # the gate: a draft expected to gain less than min_score tokens costs its verification rows for nothing
        return best if best.score >= self.config.min_score else Draft()

    def place(self, ls: _LocalState, tree, d: Draft, eos: frozenset) -> None:
        """Put draft ``d`` into the step's tree, remembering its nodes for `observe`."""
        where: dict = {}
        add_draft(tree, d, eos, where)
        cond = conditionals(Draft(probs=d.counts_probs or d.probs, parents=d.parents))
        ls.last_nodes = [(where[i], where[d.parents[i]], cond[i]) for i in range(len(d)) if i in where]

    def observe(self, ls: _LocalState, tree, path) -> None:
        """After a step verified this drafter's draft (``path``: the accepted path's tree nodes, root first):
        each tested node (its parent accepted) teaches the calibration whether it was accepted. Read by the
        next drafts, never by this step's."""
        if not tree.n or not ls.last_nodes:
            return
        on = set(path)
        for node, parent, c in ls.last_nodes:
            if parent in on:
                self.calibration.record(c, node in on)
        ls.last_nodes = []

    def draft_tree(self, dec, state, tree, cap: int) -> bool:
        ls = state.drafter_state
        self.place(ls, tree, self.speculate(ls, state, min(cap, tree.capacity)), dec.eos)
        return True  # an empty tree is a plain step

    def propose(self, dec, state, tree, start, end):
        return None

    def commit(self, dec, state, tree, path) -> None:
        self.observe(state.drafter_state, tree, path)

    def batch_adapter(self) -> ModelFreeRows:
        return ModelFreeRows(self)

    def stats(self) -> dict:
        """Lookups made, lookup time per step (both indexes), the global index's memory report, and where
        drafts are cut by cost, the measured costs and the score calibration."""
        out = {"lookups": self.lookups,
               "lookup_ms_per_step": round(1e3 * self.lookup_s / self.lookups, 4) if self.lookups else None,
               "index": self.index.memory_report()}
        if self.step_cost is not None:
            out["cost_aware"] = {"step_cost": [round(c, 3) for c in self.step_cost],
                                 "calibration": self.calibration.report()}
        return out

    def finish(self, dec, state) -> None:
        if self.learn:
            self.index.add_response(state.tokens[state.prompt_len:])


class PromptLookupDrafter:
    """Prompt lookup: a chain of ``k`` tokens after the newest earlier match of the last n-gram in the
    request's own context (n from ``max_ngram`` down to ``min_ngram``)."""

    model_free = True
    target_fingerprint = None
    max_depth = None
    supports_trees = True

    def __init__(self, k: int = 10, max_ngram: int = 3, min_ngram: int = 1, name: str | None = None):
        if k < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs k >= 1 and 1 <= min_ngram <= max_ngram, got k={k}, "
                             f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.max_nodes = k
        self.name = name or f"prompt-lookup K={k}"
        self._config = SuffixConfig(max_depth=max(max_ngram, 2), max_cached_requests=0)

    def start(self, dec, state) -> _LocalState:
        return _LocalState(TokenIndex(self._config))

    def draft_tree(self, dec, state, tree, cap: int) -> bool:
        ls = state.drafter_state
        ctx = _feed(ls, state)
        toks = ls.local.lookup(ctx, min(cap, self.k, tree.capacity), self.max_ngram, self.min_ngram)
        add_draft(tree, Draft(tokens=toks, parents=list(range(-1, len(toks) - 1))), dec.eos)
        return True

    def batch_adapter(self) -> ModelFreeRows:
        return ModelFreeRows(self)

    def propose(self, dec, state, tree, start, end):
        return None

    def commit(self, dec, state, tree, path) -> None:
        return None


class ModelFreeRows:
    """The batched decoder's adapter for a model-free drafter: per-row state only (the rows' trees are built
    by the drafter's ``draft_tree``, called per row by `draftsmith.engine.batched.BatchedSpeculativeDecoder`)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def start(self, dec, states: list, capacity: int, rows: int) -> None:
        for s in states:
            self.join(dec, s)

    def join(self, dec, state) -> None:
        state.drafter_state = self.drafter.start(dec, state)

    def begin_step(self, states: list) -> None:
        pass

    def propose(self, rows, states, trees, ranges):
        return [None] * len(rows)

    def commit(self, row: int, dec, state, tree, path) -> None:
        self.drafter.commit(dec, state, tree, path)

    def history(self, state, old, new):
        return new

    def move_row(self, src: int, dst: int, src_state) -> None:
        pass  # per-row state lives in the row's DecodeState


@dataclass
class _HybridState:
    inner: Any
    local: _LocalState
    est: float  # running mean of the trained drafter's accepted tokens per step
    unseen: list = field(default_factory=list)  # target hidden states the trained drafter has not read
    last_fresh: Any = None
    chose: str = "inner"
    since_inner: int = 0  # steps since the trained drafter last drafted (exploration)
    t_prev: float | None = None  # when the previous step's drafting began (step timing)
    step: int = 0

    @property
    def hidden(self):  # drafter features for length policies: the trained drafter's
        return getattr(self.inner, "hidden", None)

    def __copy__(self) -> "_HybridState":
        c = _HybridState(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        c.inner, c.local, c.unseen = copy.copy(self.inner), copy.copy(self.local), list(self.unseen)
        return c


class HybridDrafter:
    """A trained drafter and SuffixDecoding, chosen per step by expected tokens per second.

    Per step, with s the suffix draft's score (expected accepted tokens under the counts), e the trained
    drafter's running mean of accepted tokens per step, and r_inner, r_suffix the costs of a
    trained-drafter step and of a step verifying a suffix draft relative to a plain step (no draft): the
    choice with the most expected tokens per unit of time among the suffix draft (1 + s) / r_suffix, a
    plain step 1, and the trained drafter (1 + e) / r_inner. ``inner_cost`` fixes r_inner (and r_suffix =
    1; 1.0 compares expected accepted lengths only); None measures both online (running means of the wall
    time between consecutive steps of each kind, the first step of a generation, which holds the prefill,
    left out). Every
    ``explore_every`` steps without it, the trained drafter drafts once, so its estimate can recover.
    ``prior``: e before any step is measured; ``ema``: the weight of each new step in the running means.
    The choice reads only the history, never this step's verification: lossless. Estimates carry over
    between generations (written back by ``finish``)."""

    def __init__(self, inner: Any, suffix: SuffixDrafter, *, prior: float = 1.0, ema: float = 0.1,
                 inner_cost: float | None = None, explore_every: int = 16, name: str | None = None):
        caps = capabilities(inner)
        if caps.verify_forward is not None:
            raise ValueError(f"drafter {caps.name!r} replaces the target's "
                             "verification forward (a self-drafter): a hybrid with it is not supported")
        if caps.builds_trees:
            raise ValueError("the hybrid's trained drafter must draft from logits, not build its own trees")
        self.inner, self.suffix = inner, suffix
        self.name = name or f"{caps.name}+suffix"
        self.target_fingerprint = caps.target_fingerprint
        self.max_depth = caps.max_depth
        self.needs_target_hidden = caps.needs_target_hidden
        self.supports_trees = caps.supports_trees
        self.max_nodes = suffix.max_nodes
        self.prior = float(prior)
        self.estimate, self.ema = self.prior, float(ema)
        self.inner_cost, self.explore_every = inner_cost, int(explore_every)
        self.step_s: dict[str, float | None] = {"suffix": None, "inner": None, "plain": None}
        self.steps = {"suffix": 0, "inner": 0}
        pol = caps.default_policy
        if pol is not None:
            self.default_policy = pol
        for attr in ("vocab_size", "context_length"):
            v = getattr(inner, attr, None)
            if v is not None:
                setattr(self, attr, v)

    @property
    def compile_s(self) -> float:
        """The trained drafter's compile seconds (its compiled drafting), for the benchmarks' bookkeeping."""
        return float(getattr(self.inner, "compile_s", 0.0))

    def cost_ratio(self, kind: str = "inner") -> float:
        """A ``kind`` step's cost ("inner": a trained-drafter step, "suffix": a step verifying a suffix draft)
        relative to a plain step (no draft): fixed (``inner_cost``; suffix steps then cost 1), measured,
        or 1.0 while unmeasured."""
        if self.inner_cost is not None:
            return self.inner_cost if kind == "inner" else 1.0
        a, b = self.step_s[kind], self.step_s["plain"]
        return a / b if a and b else 1.0

    def start(self, dec, state) -> _HybridState:
        return _HybridState(self.inner.start(dec, state), self.suffix.start(dec, state), self.estimate)

    def _time(self, hs: _HybridState) -> None:
        if self.inner_cost is not None:
            return
        now = time.perf_counter()
        if hs.t_prev is not None and hs.step >= 2:  # steps committed so far; the first one holds the prefill
            old = self.step_s[hs.chose]
            dt = now - hs.t_prev
            self.step_s[hs.chose] = dt if old is None else (1 - self.ema) * old + self.ema * dt
        hs.t_prev = now

    def draft_tree(self, dec, state, tree, cap: int) -> bool:
        # drafting may be repeated for one step (exact enumeration re-drafts): everything the choice reads is
        # advanced in commit, never here
        hs: _HybridState = state.drafter_state
        self._time(hs)
        if state.fresh_hidden is not None and state.fresh_hidden is not hs.last_fresh:
            hs.unseen.append(state.fresh_hidden)
            hs.last_fresh = state.fresh_hidden
        d = self.suffix.speculate(hs.local, state, min(cap, tree.capacity))
        explore = self.explore_every > 0 and hs.since_inner >= self.explore_every
        # expected tokens per unit of a plain step's time, for each choice
        inner = (1 + hs.est) / self.cost_ratio("inner")
        suffix = (1 + d.score) / self.cost_ratio("suffix") if len(d) else 0.0
        if not explore and max(suffix, 1.0) >= inner:
            kind = "suffix" if suffix >= 1.0 else "plain"  # a plain step beats a draft not worth its cost
            hs.chose = kind
            self.steps[kind] = self.steps.get(kind, 0) + 1
            if kind == "suffix":
                self.suffix.place(hs.local, tree, d, dec.eos)
            return True
        hs.chose = "inner"
        self.steps["inner"] += 1
        if len(hs.unseen) > 1:  # hidden states of the suffix steps since the trained drafter last ran
            state.fresh_hidden = torch.cat(hs.unseen)
            hs.last_fresh = state.fresh_hidden
        hs.unseen = []
        return False

    def _as_inner(self, state, call):
        """``call()`` with the trained drafter's own state in ``state.drafter_state``; a drafter that replaces its
        state (EAGLE-3's are immutable records) has the new one kept."""
        hs: _HybridState = state.drafter_state
        state.drafter_state = hs.inner
        try:
            return call()
        finally:
            hs.inner = state.drafter_state
            state.drafter_state = hs

    def propose(self, dec, state, tree, start, end):
        return self._as_inner(state, lambda: self.inner.propose(dec, state, tree, start, end))

    def commit(self, dec, state, tree, path) -> None:
        hs: _HybridState = state.drafter_state
        hs.step += 1
        if hs.chose == "suffix":
            self.suffix.observe(hs.local, tree, path)
        if hs.chose != "inner":  # a suffix or plain step
            hs.since_inner += 1
            # a drafter that reads the target's states of every committed token (EAGLE-3) keeps this step's too
            observe = getattr(self.inner, "observe_step", None)
            if observe is not None:
                self._as_inner(state, lambda: observe(dec, state, tree, path))
            return
        hs.since_inner = 0
        if tree.n:  # a step that drafted nothing (no room, or the drafter could not) says nothing of it
            hs.est = (1 - self.ema) * hs.est + self.ema * (len(path) - 1)
        self._as_inner(state, lambda: self.inner.commit(dec, state, tree, path))

    def stats(self) -> dict:
        """The suffix member's figures, the steps each member drafted and the current estimates."""
        return {**self.suffix.stats(), "steps": dict(self.steps), "inner_estimate": round(self.estimate, 3),
                "cost_ratio": round(self.cost_ratio(), 3)}

    def finish(self, dec, state) -> None:
        self.estimate = state.drafter_state.est
        self.suffix.finish(dec, state)


@register_untrained("suffix", "SuffixDecoding: drafts from the prompt and this process's earlier responses "
                    "(model-free, default settings)")
def _suffix(target, arg: None) -> SuffixDrafter:
    return SuffixDrafter(SuffixConfig())


@register_untrained("prompt-lookup", "prompt lookup: drafts up to K tokens that followed the last n-gram in the "
                    "prompt and response (model-free)", arg="K")
def _prompt_lookup(target, k: int) -> PromptLookupDrafter:
    if k < 1:
        raise ValueError(f"prompt-lookup:{k}: K must be >= 1")
    return PromptLookupDrafter(k=k)
