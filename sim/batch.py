"""The batch-aware length policy (engine/batch_policy.py) under a cost profile: which K per batch size a
profile's hardware would pick, and the simulated goodput.

A step of b sequences drafting chains of K is priced by `draftsmith.sim.steps.step_seconds` as the batched
decoder's step: b (K + 1) rows at the given context, b K drafted nodes, K drafter passes. With per-depth
acceptance (from acceptance traces or a step trace), that is the `GoodputTable` the policy reads, built
from the profile instead of from measurements, so `BatchAwareLength(batch_table(...))` is the policy a
user of that hardware would run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from draftsmith.engine.batch_policy import GoodputTable
from draftsmith.sim.profile import Profile
from draftsmith.sim.steps import Step, step_seconds


def batch_table(profile: Profile, drafter: str, acceptance: Sequence[float], batch_sizes: Sequence[int],
                ks: Sequence[int], context: int = 256) -> GoodputTable:
    """Simulated step costs cost[b][K] (K = 0: plain batched decoding) and ``acceptance`` as a goodput table."""
    costs: dict[int, dict[int, float]] = {}
    for b in batch_sizes:
        if b < 1:
            raise ValueError(f"batch sizes must be >= 1, got {b}")
        costs[int(b)] = {int(k): step_seconds(Step(rows=b * (k + 1), context=context, nodes=b * k, passes=k,
                                                    accepted=0, emitted=b, live=b), profile,
                                               drafter if k else None, batched=True)
                         for k in sorted({0, *ks})}
    return GoodputTable(costs, [float(a) for a in acceptance], {"profile": profile.name, "drafter": drafter,
                                                                "context": context, "simulated": True})


def acceptance_by_depth(position: np.ndarray, ratio: np.ndarray, max_depth: int) -> list[float]:
    """Per-depth acceptance from acceptance-trace rows: the mean of ``ratio`` (P(accepted | prefix accepted))
    over the rows drafted at each depth."""
    out = []
    for d in range(1, max_depth + 1):
        m = position == d
        out.append(float(ratio[m].mean()) if m.any() else 0.0)
    return out
