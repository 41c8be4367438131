"""Distributed speculative inference (DSI, arXiv 2405.14105) against speculative (SI) and plain decoding.

Offline model, in time units where one target forward costs 1 and one drafter forward costs ``c``
(docs/methods.md, "Simulation"). A drafter proposes ``k`` tokens per lookahead (fewer near the end);
the number it gets accepted before the first rejection is Geometric: P(j accepted) = a^j (1 - a),
capped at the lookahead.

  * plain (non-SI): S tokens cost S.
  * SI: every iteration drafts k' = min(k, tokens left - 1) tokens (cost k' c), verifies them with
    one target forward (cost 1) and emits the accepted drafts + 1.
  * DSI with speculation parallelism (enough target instances that verifications never queue, i.e.
    at least ceil(1 / (k c)) of them): the drafter never waits for a verdict. Consecutive lookaheads
    run back to back while they are fully accepted (their verifications overlap the drafting, adding
    no time and no bonus token); the first rejection costs one target forward, emits the accepted
    drafts + the target's token, and restarts drafting from there. A lookahead that follows a
    rejection and has nothing accepted is abandoned as soon as the target's token is known, so its
    drafting adds no time. A plain-decoding instance runs alongside, so a window between
    rejections never costs more than its tokens' plain time.

The acceptance draws are shared between SI and DSI (common random numbers), and every figure is the
mean over ``repeats`` sequences of ``S`` tokens. `speedups` takes the best lookahead for each method
(DSI only among those its number of target instances can serve).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _check(c: float, a: float, k: int) -> None:
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"drafter cost c (a drafter forward / a target forward) must be positive, got {c}")
    if c > 1:
        raise ValueError(f"drafter cost c = {c} > 1: a drafter slower than the target is outside the model")
    if not 0 <= a < 1:
        raise ValueError(f"acceptance rate must be in [0, 1), got {a}")
    if k < 1:
        raise ValueError(f"lookahead must be >= 1, got {k}")


def draws(a: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Accepted drafts before the first rejection, uncapped: Geometric(1 - a) - 1."""
    if a <= 0:
        return np.zeros(n, dtype=np.int64)
    return rng.geometric(1.0 - a, size=n) - 1


def si_cost(acc: np.ndarray, k: int, c: float, S: int) -> float:
    left, t, i = S, 0.0, 0
    while left > 0:
        kk = min(k, left - 1)
        got = min(int(acc[i]), kk)
        i += 1
        t += kk * c + 1.0
        left -= got + 1
    return t


def dsi_cost(acc: np.ndarray, k: int, c: float, S: int) -> float:
    left, t, i = S, 0.0, 0
    while left > 0:
        cost, toks, first = 0.0, 0, True
        while True:
            kk = min(k, left - toks - 1)
            got = min(int(acc[i]), kk)
            i += 1
            if not (first and got == 0):
                cost += kk * c
            first = False
            if kk > 0 and got == kk:  # fully accepted: verification overlapped, drafting goes on
                toks += kk
                continue
            cost += 1.0  # the rejecting (or last) lookahead waits for its target forward
            toks += got + 1
            break
        t += min(cost, float(toks))
        left -= toks
    return t


@dataclass(frozen=True)
class Cell:
    c: float
    a: float
    k: int


def min_servers(k: int, c: float) -> int:
    """Target instances DSI needs so that verifications never queue: ceil(1 / (k c))."""
    return math.ceil(1.0 / (k * c) - 1e-12)


def costs(c: float, a: float, k: int, *, S: int = 1000, repeats: int = 5, seed: int = 42) -> dict:
    """Mean time of plain, SI and DSI for S tokens (time units: target forwards)."""
    _check(c, a, k)
    rng = np.random.default_rng(seed)
    si, dsi = [], []
    for _ in range(repeats):
        acc = draws(a, 2 * S + 2, rng)  # at most one draw per token, and one per lookahead
        si.append(si_cost(acc, k, c, S))
        dsi.append(dsi_cost(acc, k, c, S))
    return {"plain": float(S), "si": float(np.mean(si)), "dsi": float(np.mean(dsi))}


def si_expected_speedup(c: float, a: float, k: int) -> float:
    """Closed form for long sequences: E[tokens per iteration] / iteration cost
    = ((1 - a^(k+1)) / (1 - a)) / (1 + k c)."""
    _check(c, a, k)
    return ((1 - a ** (k + 1)) / (1 - a)) / (1 + k * c)


def speedups(c: float, a: float, ks: Sequence[int] = range(1, 21), *, servers: int = 7, S: int = 1000,
             repeats: int = 5, seed: int = 42) -> dict:
    """Best-lookahead figures at one (c, a): SI and DSI speedups over plain, DSI over SI, DSI over the
    better of the two. DSI uses only lookaheads its ``servers`` target instances can serve."""
    best_si, best_dsi, k_si, k_dsi = math.inf, math.inf, None, None
    for k in ks:
        r = costs(c, a, k, S=S, repeats=repeats, seed=seed)
        if r["si"] < best_si:
            best_si, k_si = r["si"], k
        if min_servers(k, c) <= servers and r["dsi"] < best_dsi:
            best_dsi, k_dsi = r["dsi"], k
    if k_dsi is None:
        raise ValueError(f"no lookahead in {list(ks)} can be served by {servers} target instances at c={c} "
                         f"(needs k >= {math.ceil(1 / (servers * c))})")
    return {"c": c, "a": a, "si_over_plain": S / best_si, "dsi_over_plain": S / best_dsi,
            "dsi_over_si": best_si / best_dsi, "dsi_over_best": min(best_si, float(S)) / best_dsi,
            "k_si": k_si, "k_dsi": k_dsi, "servers": servers}


def grid(cs: Sequence[float], accs: Sequence[float], **kw) -> list[dict]:
    return [speedups(float(c), float(a), **kw) for a in accs for c in cs]


def heatmap_axes(ndim: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """The paper's grid: c in linspace(0, 1, ndim + 1) floored at 0.01; a in the same, clipped to [0.01, 0.99]."""
    cs = np.maximum(np.linspace(0, 1, ndim + 1), 0.01)
    accs = np.clip(np.linspace(0, 1, ndim + 1), 0.01, 0.99)
    return cs, accs
