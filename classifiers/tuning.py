"""Threshold tuning and classifier quality on the calibration split of a trace set.

Simulation: each calibration round was drafted at a fixed length K and every row
carries ratio_i = P(d_i accepted | d_1..d_{i-1} accepted) (traces.py). A policy that
keeps n of the K drafts emits, in expectation, 1 + sum_{j<=n} prod_{i<=j} ratio_i
tokens, and the step costs ``verify[n] + draft_per_forward * forwards`` units of a
1-row target forward (the cost model measured when the traces were recorded). A
threshold is chosen to maximise expected tokens per unit of cost over all rounds:
the same quantity tokens/s measures, on held-out rounds. Rounds are simulated
independently (a shorter round does not shift where the next one starts).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from draftsmith.classifiers.traces import TraceError, Traces


def expected_emitted(ratios: np.ndarray, n: int) -> float:
    """1 + sum_{j<=n} prod_{i<=j} ratio_i: expected tokens one step emits when n drafts are verified."""
    return 1.0 + float(np.cumprod(ratios[:n]).sum()) if n else 1.0


def round_cost(cost: dict, n: int, forwards: int) -> float:
    verify = cost["verify"]
    return float(verify[min(n, len(verify) - 1)]) + cost.get("draft_per_forward", 0.0) * forwards


def simulate(rounds: list[np.ndarray], ratio: np.ndarray, lengths: list[tuple[int, int]], cost: dict) -> dict:
    """Figures of a policy that kept ``lengths[r] = (n drafts, drafter forwards)`` in round r."""
    emitted = sum(expected_emitted(ratio[idx], n) for idx, (n, _) in zip(rounds, lengths))
    spent = sum(round_cost(cost, n, f) for n, f in lengths)
    drafted = sum(n for n, _ in lengths)
    return {"tokens_per_cost": emitted / spent if spent else 0.0, "tau": emitted / max(len(rounds), 1),
            "mean_draft_len": drafted / max(len(rounds), 1)}


def fixed_lengths(rounds: list[np.ndarray], k: int) -> list[tuple[int, int]]:
    # a fixed-length chain of k drafts runs k drafter forwards (the k-th draft's state is never needed)
    return [(min(k, len(idx)), min(k, len(idx))) for idx in rounds]


def best_fixed(rounds: list[np.ndarray], ratio: np.ndarray, cost: dict, k_max: int) -> dict:
    """Simulated figures of every fixed K (1..k_max) and the best one."""
    per = {k: simulate(rounds, ratio, fixed_lengths(rounds, k), cost) for k in range(1, k_max + 1)}
    best = max(per, key=lambda k: per[k]["tokens_per_cost"])
    return {"per_k": per, "best_k": best, "best": per[best]}


def tune_threshold(lengths_at: Callable[[float], list[tuple[int, int]]], grid: np.ndarray, rounds, ratio,
                   cost: dict) -> dict:
    """The threshold of ``grid`` with the most expected tokens per unit of cost (ties: the first)."""
    scores = [(float(t), simulate(rounds, ratio, lengths_at(float(t)), cost)) for t in grid]
    t, best = max(scores, key=lambda x: x[1]["tokens_per_cost"])
    return {"threshold": t, "simulated": best,
            "curve": [{"threshold": a, **b} for a, b in scores[:: max(1, len(scores) // 25)]]}


def tune_threshold_and_cap(lengths_at: Callable[[float], list[tuple[int, int]]], grid: np.ndarray, rounds, ratio,
                           cost: dict, k_max: int) -> dict:
    """`tune_threshold` jointly with the policy's cap on drafts per round (1..k_max): a round the policy
    would draft past the cap stops there, as a fixed length does. With a threshold that never stops,
    cap K is fixed length K, so the tuned policy is never worse than the best fixed K on these rounds."""
    best = None
    for cap in range(1, max(1, k_max) + 1):
        def capped(t, cap=cap):
            return [(min(n, cap), min(f, cap)) for n, f in lengths_at(t)]
        r = tune_threshold(capped, grid, rounds, ratio, cost)
        r["cap"] = cap
        if best is None or r["simulated"]["tokens_per_cost"] > best["simulated"]["tokens_per_cost"] + 1e-12:
            best = r
    return best


def quality(pred: np.ndarray, ratio: np.ndarray, bins: int = 10) -> dict:
    """ROC AUC (soft labels: each row counts as accepted with weight ratio, rejected with 1 - ratio),
    Brier score, and calibration (expected calibration error and a reliability table over ``bins``)."""
    from sklearn.metrics import roc_auc_score

    if len(pred) == 0:
        raise TraceError("no calibration rows to measure the predictor on")
    y = np.concatenate([np.ones(len(ratio)), np.zeros(len(ratio))])
    w = np.concatenate([ratio, 1.0 - ratio])
    keep = w > 0
    auc = None
    if (y[keep] == 1).any() and (y[keep] == 0).any():
        auc = float(roc_auc_score(y[keep], np.concatenate([pred, pred])[keep], sample_weight=w[keep]))
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(pred, edges) - 1, 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        m = which == b
        if not m.any():
            continue
        mp, mr = float(pred[m].mean()), float(ratio[m].mean())
        ece += m.mean() * abs(mp - mr)
        table.append({"bin": f"{edges[b]:.1f}-{edges[b + 1]:.1f}", "rows": int(m.sum()), "predicted": mp,
                      "observed": mr})
    return {"roc_auc": auc, "brier": float(np.mean((pred - ratio) ** 2)), "ece": float(ece),
            "rows": int(len(pred)), "base_rate": float(ratio.mean()), "reliability": table}


def calibration_rounds(cal: Traces) -> tuple[list[np.ndarray], np.ndarray]:
    cal.check_trainable("tuning on the calibration split")
    return cal.rounds(), cal.columns["ratio"].astype(np.float64)
