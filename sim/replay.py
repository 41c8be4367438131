"""Length policies replayed on recorded acceptance traces under a cost profile (simulated figures).

Input: a trace set from ``draftsmith traces`` (classifiers/traces.py: every round drafted at a fixed
length K, every drafted token with its draft-side features and ``ratio`` = P(accepted | its prefix
accepted)). A policy that keeps n of a round's K drafts after f drafter forwards emits, in expectation,
1 + sum_{j<=n} prod_{i<=j} ratio_i tokens at a cost of verify[n] + f * draft_per_forward units of a
1-row target forward (classifiers/tuning.py); the unit prices come from a `Profile`
(`Profile.relative_cost`), so the same rounds can be priced as on this CPU or on a GPU.

Policies: fixed K (1..max_len), the confidence stop (stop before a candidate whose top-1 draft
probability is under a threshold; Hugging Face's 0.4 and Kangaroo's double early exit, 0.6 with at most
6 drafts, at their published settings and tuned), DISCO (logistic classifier, classifiers/disco) and
SpecDec++ (acceptance head, classifiers/specdec), both trained on the trace set's train split.

Every tuned setting (K, threshold, cap, mode) is chosen on one half of the calibration rounds (split by
prompt) and scored on the other half, both ways; the figures are out-of-sample. Rounds are simulated
independently: a shorter round does not move where the next one starts.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from draftsmith.classifiers.disco import model as disco
from draftsmith.classifiers.specdec import model as specdec
from draftsmith.classifiers.traces import Traces, load_traces
from draftsmith.classifiers.tuning import calibration_rounds, simulate, tune_threshold_and_cap

Lengths = Callable[[list, float], list[tuple[int, int]]]  # (rounds, threshold) -> [(n drafts, forwards)]


def _before(scores: np.ndarray) -> Lengths:
    """Stop before the first candidate whose score is under the threshold (its drafter forward ran)."""
    def f(rounds, t):
        out = []
        for idx in rounds:
            below = np.flatnonzero(scores[idx] < t)
            n = int(below[0]) if len(below) else len(idx)
            out.append((n, n + 1 if n < len(idx) else n))
        return out
    return f


def _after(scores: np.ndarray) -> Lengths:
    """Submit the first candidate whose score is under the threshold, then stop (no extra forward)."""
    def f(rounds, t):
        out = []
        for idx in rounds:
            below = np.flatnonzero(scores[idx] < t)
            n = int(below[0]) + 1 if len(below) else len(idx)
            out.append((n, n))
        return out
    return f


def _specdec(accept: list[np.ndarray]) -> Lengths:
    """SpecDec++: cumulative acceptance product, stop once 1 - prod > threshold (one-token lag).
    ``accept[r][k-1]`` = the head's P(accept) from the state after d_k of round r."""
    where = {}

    def f(rounds, t):
        out = []
        for idx in rounds:
            a = where[id(idx)]
            n, cum = len(idx), 1.0
            for k in range(1, len(idx)):
                cum *= a[k - 1]
                if 1.0 - cum > t:
                    n = k + 1
                    break
            out.append((n, n))
        return out
    f.where = where  # filled by the caller: id(round) -> its acceptance array
    return f


def _fixed(rounds, k) -> list[tuple[int, int]]:
    return [(min(int(k), len(idx)), min(int(k), len(idx))) for idx in rounds]


def _score(rounds, ratio, lengths, cost) -> tuple[float, float, int]:
    s = simulate(rounds, ratio, lengths, cost)
    n = max(len(rounds), 1)
    return s["tau"] * n, s["tokens_per_cost"] and s["tau"] * n / s["tokens_per_cost"], sum(x for x, _ in lengths)


def _cross(rounds, folds, ratio, cost, choose, apply) -> dict:
    """2-fold: settings chosen on one fold (``choose(fold_rounds)``), scored on the other
    (``apply(settings, other_rounds)`` -> lengths); totals over both held-out folds."""
    em = sp = dr = 0.0
    chosen = []
    for f in (0, 1):
        tune = [r for r, g in zip(rounds, folds) if g == f]
        held = [r for r, g in zip(rounds, folds) if g != f]
        if not tune or not held:
            raise ValueError("the calibration split needs rounds from at least two prompts")
        st = choose(tune)
        chosen.append(st)
        e, s, d = _score(held, ratio, apply(st, held), cost)
        em, sp, dr = em + e, sp + s, dr + d
    n = len(rounds)
    return {"tokens_per_cost": em / sp, "tau": em / n, "mean_draft_len": dr / n, "chosen": chosen}


def replay(traces_dir, cost: dict, *, max_len: int = 8, temperature: float = 0.0, predictors: bool = True,
           epochs: int = 20, seed: int = 0) -> dict:
    """Out-of-sample tokens per unit of cost of every policy on a trace set, priced by ``cost``."""
    train = load_traces(traces_dir, "train").at_temperature(temperature)
    cal = load_traces(traces_dir, "calibration").at_temperature(temperature)
    cal = Traces(cal.columns, {**cal.meta, "cost": cost}, cal.split)
    rounds, ratio = calibration_rounds(cal)
    k = min(max_len, int(cal.columns["position"].max()))
    folds = [int(cal.columns["prompt"][idx[0]]) % 2 for idx in rounds]
    grid_conf = np.linspace(0.0, 1.0, 41)

    def best_k(rs):
        return max(range(1, k + 1), key=lambda kk: simulate(rs, ratio, _fixed(rs, kk), cost)["tokens_per_cost"])

    out: dict = {"rounds": len(rounds), "max_len": k, "cost": cost, "policies": {}}
    P = out["policies"]
    P["best fixed K"] = _cross(rounds, folds, ratio, cost, best_k, lambda kk, rs: _fixed(rs, kk))
    for kk in range(1, k + 1):
        e, s, d = _score(rounds, ratio, _fixed(rounds, kk), cost)
        P[f"K={kk}"] = {"tokens_per_cost": e / s, "tau": e / len(rounds), "mean_draft_len": d / len(rounds)}

    def threshold_policy(lengths: Lengths, grid, cap_max=k):
        def choose(rs):
            r = tune_threshold_and_cap(lambda t: lengths(rs, t), grid, rs, ratio, cost, cap_max)
            return (r["threshold"], r["cap"])

        def apply(st, rs):
            t, cap = st
            return [(min(n, cap), min(f, cap)) for n, f in lengths(rs, t)]
        return choose, apply

    top1 = cal.columns["top1"].astype(np.float64)
    conf = _before(top1)

    def fixed_setting(t, cap):
        return lambda rs: (t, cap), lambda st, rs: [(min(n, st[1]), min(f, st[1])) for n, f in conf(rs, st[0])]

    P["confidence 0.4 (HF), cap 8"] = _cross(rounds, folds, ratio, cost, *fixed_setting(0.4, k))
    P["double early exit 0.6, cap 6 (Kangaroo)"] = _cross(rounds, folds, ratio, cost, *fixed_setting(0.6, min(6, k)))
    P["confidence, tuned"] = _cross(rounds, folds, ratio, cost, *threshold_policy(conf, grid_conf))
    if predictors:
        m = disco.fit(train, cal, max_len=k)
        pred = m.predict(disco.feature_matrix(cal))
        grid = np.unique(np.quantile(pred, np.linspace(0, 1, 41)))
        best = None
        for mode, lf in (("before", _before(pred)), ("after", _after(pred))):
            r = _cross(rounds, folds, ratio, cost, *threshold_policy(lf, grid))
            r["mode"] = mode
            if best is None or r["tokens_per_cost"] > best["tokens_per_cost"]:
                best = r
        P["DISCO, tuned"] = best
        head = specdec.train_head(train, epochs=epochs, seed=seed)
        x, _, where = specdec.pairs(cal)
        with torch.no_grad():
            a = head.accept_prob(torch.from_numpy(x)).numpy().astype(np.float64) if len(x) else np.zeros(0)
        sd = _specdec([])
        for idx, w in zip(rounds, where):
            sd.where[id(idx)] = a[w]
        P["SpecDec++, tuned"] = _cross(rounds, folds, ratio, cost, *threshold_policy(sd, np.linspace(0, 0.99, 34)))
    base = P["best fixed K"]["tokens_per_cost"]
    for v in P.values():
        v["vs_best_fixed"] = v["tokens_per_cost"] / base - 1.0
    return out
