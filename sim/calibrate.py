"""Measure a cost profile on this machine: ``draftsmith simulate calibrate``.

Two measurements, both with the layout decoding uses (`draftsmith.engine.cpu_layout`):

1. The target's forward time over a grid of row counts x cached contexts (random tokens after a
   prefix written into the cache; sizes interleaved within every repeat, median of the repeats), the
   profile's ``forward`` table.
2. The rest of a step, from short runs of the real decoders on calibration prompts: plain decoding,
   chains of several lengths, a tree, batched chains. Each run's measured time minus the table's price
   of its forwards is a sum of per-step host overhead, the drafter's per-step, per-pass and per-node
   costs, and the batched decoder's per-step and per-sequence costs, each counted from the run's steps;
   least squares over the runs (coefficients held >= 0) gives them (`fit_step_costs`).

``clock="cpu"`` times with this process's CPU time instead of the wall clock: on a machine shared
with other work (more runnable processes than cores) the wall clock measures the neighbours too. It
is right only with one torch thread.

Use calibration prompts that the validation does not decode (training prompts, say), so a validation
error measures the model, not a fit to the same steps.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.drafters import project
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.policies import FixedLength
from draftsmith.sim.profile import DrafterCost, ForwardTable, Overhead, Profile
from draftsmith.sim.steps import Run, from_batch_results, from_results, target_identity

DEFAULT_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
DEFAULT_CONTEXTS = [0, 128, 256, 512]
# "cpu": this process's CPU time, for a machine shared with other work (one torch thread only: it sums threads)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class ForwardTimer:
    """Times target forwards (body + LM head over every row) per (context, rows), through the forward decoders
    built on the target use (its ``fast_body`` when set, else the model's body); `round` adds one timing
    of every cell (cells interleaved), `table` gives the medians. Rounds can be spread over a run so
    that the table sees the same machine load as the decoding it prices."""

    @torch.no_grad()
    def __init__(self, target, rows: Sequence[int] = DEFAULT_ROWS, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                 clock: str = "wall"):
        self.clock = CLOCKS[clock]
        self.rows, self.contexts = sorted(set(int(r) for r in rows)), sorted(set(int(c) for c in contexts))
        if self.rows[0] < 1 or self.contexts[0] < 0:
            raise ValueError(f"rows must be >= 1 and contexts >= 0, got {self.rows}, {self.contexts}")
        model = target.model
        self.dev, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self.body, self.head = model.get_decoder(), model.get_output_embeddings()
        # the forward decoders built on this target run: our static-shape one when `use_fast_forward` set it
        self.fast = getattr(target, "fast_body", None)
        cmax, rmax = self.contexts[-1], self.rows[-1]
        self.cache = KVCache.for_model(model, cmax + rmax + 1)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, target.vocab_size, (1, cmax + rmax), generator=g).to(self.dev)
        if cmax:
            self.cache.set_write(0)
            self.body(input_ids=self.ids[:, :cmax], position_ids=torch.arange(cmax, device=self.dev)[None],
                      **cache_arg(self.body, self.cache), use_cache=True)
        self.cells = [(c, n) for c in self.contexts for n in self.rows]
        self.times: dict[tuple[int, int], list[float]] = {x: [] for x in self.cells}
        self.head_times: dict[int, list[float]] = {n: [] for n in self.rows}
        for c, n in self.cells:  # warm-up
            self.once(c, n)

    @torch.no_grad()
    def once(self, c: int, n: int) -> tuple[float, float]:
        """(body seconds, LM-head seconds) of one forward over n rows after c cached entries."""
        # the first c cache entries hold the prefix (entries past c are overwritten or masked out)
        dev, cmax = self.dev, self.contexts[-1]
        # as the decoder does: no mask for a plain causal block (no prefix, or one row)
        m = None if c == 0 or n == 1 else prefix_block_mask(
            c, torch.ones(n, n, dtype=torch.bool, device=dev).tril(), self.dtype)
        self.cache.set_write(c)
        kw = dict(input_ids=self.ids[:, cmax:cmax + n], position_ids=torch.arange(c, c + n, device=dev)[None],
                  attention_mask=m, use_cache=True)
        t0 = self.clock()
        if self.fast is not None:
            h = self.fast(**kw, cache=self.cache, want_logits=False).last_hidden_state[0]
        else:
            h = self.body(**kw, **cache_arg(self.body, self.cache)).last_hidden_state[0]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = self.clock()
        project(self.head, h)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return t1 - t0, self.clock() - t1

    def round(self) -> None:
        for c, n in self.cells:
            body, head = self.once(c, n)
            self.times[(c, n)].append(body)
            self.head_times[n].append(head)

    def table(self) -> ForwardTable:
        if not self.times[self.cells[0]]:
            raise ValueError("no forward timed yet: call round() first")
        med = {x: statistics.median(v) for x, v in self.times.items()}
        return ForwardTable(rows=self.rows, contexts=self.contexts,
                            seconds=[[med[(c, n)] for n in self.rows] for c in self.contexts],
                            head_seconds=[statistics.median(self.head_times[n]) for n in self.rows])


def measure_forward_table(target, rows: Sequence[int] = DEFAULT_ROWS, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                          repeats: int = 5, log: Callable[[str], None] | None = None) -> ForwardTable:
    """Seconds of a target forward per (context, rows): the median of ``repeats`` interleaved rounds."""
    timer = ForwardTimer(target, rows, contexts)
    for rep in range(repeats):
        timer.round()
        if log:
            log(f"forward table: repeat {rep + 1}/{repeats}")
    return timer.table()


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop a negative one and refit, until none is)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if keep:
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            coef[keep] = sol
        neg = [i for i in keep if coef[i] < 0]
        if not neg:
            return coef
        keep.remove(min(neg, key=lambda i: coef[i]))


FIT_TERMS = ("overhead.step_s", "drafter.step_s", "drafter.pass_s", "drafter.node_s", "overhead.batch_step_s",
             "overhead.sequence_s")


def run_terms(run: Run, batched: bool) -> np.ndarray:
    """How many times a run pays each of `FIT_TERMS` (steps, drafting steps, passes, nodes, batched steps,
    extra sequences)."""
    d = [s for s in run.steps if s.nodes > 0]
    return np.array([len(run.steps), len(d), sum(s.passes for s in d), sum(s.nodes for s in d),
                     len(run.steps) if batched else 0, sum(s.live - 1 for s in run.steps) if batched else 0], float)


def fit_step_costs(table_profile: Profile, runs: list[tuple[Run, float, bool]]) -> tuple[Overhead, DrafterCost | None,
                                                                                         dict]:
    """Overheads and the drafter's cost from whole runs: each run's measured seconds minus the forward table's
    price of its forwards (prefill included) is a sum of `FIT_TERMS` counted by `run_terms`; least squares
    over the runs, coefficients >= 0."""
    if not runs:
        raise ValueError("calibration needs timed runs")
    x, y = [], []
    for run, secs, batched in runs:
        known = sum(table_profile.forward_s(n, 0, 0) for n in run.prefill_rows) + sum(
            table_profile.forward_s(s.rows, s.context, min(s.rows, s.nodes + s.live)) for s in run.steps)
        x.append(run_terms(run, batched))
        y.append(secs - known)
    X, Y = np.array(x), np.array(y)
    used = X.any(axis=0)
    coef = np.zeros(X.shape[1])
    scale = np.where(used, X.max(axis=0), 1.0)
    coef[used] = _nonneg_lstsq(X[:, used] / scale[used], Y)  # columns scaled to one magnitude
    coef = coef / scale
    resid = Y - X @ coef
    report = {"runs": len(runs), "terms": dict(zip(FIT_TERMS, map(float, coef))),
              "residual_rms_s": float(np.sqrt(np.mean(resid ** 2))), "mean_run_s": float(np.mean([r[1] for r in runs]))}
    drafter = None
    if used[1:4].any():
        drafter = DrafterCost(step_s=float(coef[1]), pass_s=float(max(coef[2], 1e-7)), node_s=float(coef[3]),
                              source="fitted by `draftsmith simulate calibrate` on decoder runs")
    return Overhead(step_s=float(coef[0]), node_s=0.0, batch_step_s=float(coef[4]), sequence_s=float(coef[5])), \
        drafter, report


class Calibrator:
    """Calibration in rounds (`round`: one forward-table round + every calibration decoder on one prompt, the
    batched ones on a group of prompts), then `fit`. Rounds can be interleaved with the runs a profile is
    meant to price, so that both see the same load on a shared machine."""

    def __init__(self, target, *, name: str, hardware: str, drafter: Any = None, drafter_name: str | None = None,
                 tree: Any = None, tree_depth: int | None = None, ks: Sequence[int] = (1, 2, 4, 6),
                 batch_sizes: Sequence[int] = (2, 4), batch_k: int = 2, max_new_tokens: int = 32,
                 rows: Sequence[int] = DEFAULT_ROWS, contexts: Sequence[int] = DEFAULT_CONTEXTS, command: str = "",
                 clock: str = "wall"):
        self.target, self.name, self.hardware, self.command = target, name, hardware, command
        self.drafter_name = drafter_name or getattr(drafter, "name", "drafter")
        self.max_new_tokens, self.tree_depth = max_new_tokens, tree_depth
        self.tid = target_identity(target)
        self.timer = ForwardTimer(target, rows, contexts, clock)
        self.decs: dict[str, tuple[Any, dict]] = {"plain": (SpeculativeDecoder(target), dict(mode="plain",
                                                                                                drafter=None))}
        self.batched: dict[int, Any] = {}
        self.batch_k = batch_k
        if drafter is not None:
            for k in ks:
                self.decs[f"K={k}"] = (SpeculativeDecoder(target, drafter, policy=FixedLength(k)),
                                       dict(mode="chain", drafter=self.drafter_name))
            if tree is not None:
                self.decs["tree"] = (SpeculativeDecoder(target, drafter, tree=tree),
                                     dict(mode="tree", drafter=self.drafter_name, tree_depth=tree_depth))
            self.batched = {b: BatchedSpeculativeDecoder(target, drafter, k=batch_k) for b in batch_sizes}
        self.clock = CLOCKS[clock]
        self.runs: list[tuple[Run, float, bool]] = []
        self.rounds = 0
        self._warm = False

    def round(self, prompts: Sequence[Sequence[int]], i: int) -> None:
        """One table round, every single-sequence decoder on prompt i, every batched one on the b prompts from i
        (wrapping around)."""
        ids = [list(p) for p in prompts]
        too_long = [len(p) for p in ids if len(p) - 1 > self.timer.rows[-1]]
        if too_long:
            raise ValueError(f"{len(too_long)} calibration prompts are longer than the table's {self.timer.rows[-1]} "
                             f"rows; add larger rows or use shorter prompts")
        if not self._warm:
            for d, _ in self.decs.values():
                d.generate(ids[0], 4)
            for d in self.batched.values():
                d.generate([ids[0]], 4)
            self._warm = True
        self.timer.round()
        p = ids[i % len(ids)]
        for key, (d, kw) in self.decs.items():
            t0 = self.clock()
            r = d.generate(p, self.max_new_tokens, seed=i)
            secs = self.clock() - t0
            self.runs.append((from_results([r], target_id=self.tid, **kw).runs[0], secs, False))
        for b, d in self.batched.items():
            group = [ids[(i + j) % len(ids)] for j in range(b)]
            t0 = self.clock()
            r = d.generate(group, self.max_new_tokens, seed=i)
            secs = self.clock() - t0
            self.runs.append((from_batch_results([r], target_id=self.tid, drafter=self.drafter_name).runs[0], secs,
                              True))
        self.rounds += 1

    def fit(self) -> tuple[Profile, dict]:
        prof = Profile(name=self.name, hardware=self.hardware, source=self.command or "draftsmith simulate calibrate",
                       assumptions=["forward times: medians of interleaved rounds on this machine (shared with other "
                                    "work); contexts beyond the table are clamped to its largest",
                                    "host overheads and the drafter's cost: least squares on the residuals of "
                                    "calibration decoding steps (see draftsmith.sim.calibrate)"],
                       target=self.tid, forward=self.timer.table())
        overhead, dcost, report = fit_step_costs(prof, self.runs)
        prof.overhead = overhead
        if dcost is not None:
            prof.drafters = {self.drafter_name: dcost}
        report.update(rounds=self.rounds, max_new_tokens=self.max_new_tokens, decoders=sorted(self.decs),
                      batch_sizes=sorted(self.batched), batch_k=self.batch_k)
        return prof, report


def calibrate(target, prompts: Sequence[Sequence[int]], *, rounds: int | None = None,
              log: Callable[[str], None] | None = None, **kw) -> tuple[Profile, dict]:
    """`Calibrator` rounds over ``prompts`` (one round per prompt unless ``rounds``), then the fit."""
    cal = Calibrator(target, **kw)
    n = rounds or len(prompts)
    for i in range(n):
        cal.round(prompts, i)
        if log:
            log(f"calibration round {i + 1}/{n}")
    return cal.fit()
