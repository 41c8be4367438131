"""A batch-aware draft length (SmartSpec-style): K per step from the live batch size, by measured goodput.

SmartSpec (Liu et al., 2024) picks the speculation length that maximises
goodput = tokens committed per second. On one machine that is

    goodput(b, K) = b * E(K) / cost(b, K)

with ``E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j`` the expected tokens one row
commits in a step of K drafted tokens (``a_j`` the measured acceptance at
depth j given depth j-1 accepted, metrics.acceptance_by_position), and
``cost(b, K)`` the measured wall time of one batched step of b rows (draft +
verify + commit). K = 0 is plain batched decoding (E = 1), so the policy
never picks speculation where the measurements say it loses. As b grows the
verification forward stops being memory-bound and cost(b, K) grows with K,
which is why the best K falls with the batch.

`calibrate` measures both on this machine with the batched decoder itself:
cost(b, K) as the median step time of steps with all b rows live,
interleaved over repeats; acceptance from the K = max runs. The choice
depends only on the live batch size, never on a step's drafts, so decoding
stays lossless.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from draftsmith.engine.metrics import acceptance_by_position


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Expected tokens a row commits in one step drafting a chain of ``k`` (the final token included)."""
    e, run = 1.0, 1.0
    for j in range(k):
        a = acceptance[j] if j < len(acceptance) else 0.0
        run *= max(0.0, min(1.0, a or 0.0))
        e += run
    return e


@dataclass
class GoodputTable:
    """Measured step costs ``costs[b][k]`` (seconds) and per-depth acceptance; K = 0 is plain decoding."""

    costs: dict[int, dict[int, float]]
    acceptance: list[float]
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.costs:
            raise ValueError("a goodput table needs at least one measured batch size")
        self.costs = {int(b): {int(k): float(c) for k, c in row.items()} for b, row in self.costs.items()}
        for b, row in self.costs.items():
            if 0 not in row:
                raise ValueError(f"batch size {b}: the plain step (K = 0) must be measured, it is always a choice")
            bad = [k for k, c in row.items() if not c > 0]
            if bad:
                raise ValueError(f"batch size {b}: step costs must be > 0 (K = {bad})")

    def cost(self, b: int, k: int) -> float | None:
        """Step cost at batch size b: linear between the two nearest measured sizes, clamped outside."""
        sizes = sorted(s for s in self.costs if k in self.costs[s])
        if not sizes:
            return None
        if b <= sizes[0]:
            return self.costs[sizes[0]][k]
        if b >= sizes[-1]:
            return self.costs[sizes[-1]][k]
        lo = max(s for s in sizes if s <= b)
        hi = min(s for s in sizes if s >= b)
        if lo == hi:
            return self.costs[lo][k]
        w = (b - lo) / (hi - lo)
        return (1 - w) * self.costs[lo][k] + w * self.costs[hi][k]

    def ks(self) -> list[int]:
        return sorted({k for row in self.costs.values() for k in row})

    def goodput(self, b: int, k: int) -> float:
        """Tokens committed per second by a step of b rows drafting K (0 when K was not measured)."""
        c = self.cost(b, k)
        return b * expected_tokens(self.acceptance, k) / c if c else 0.0

    def best_k(self, b: int, margin: float = 0.0) -> int:
        """The K of highest goodput at batch size b (ties: the shorter draft); speculation (K > 0) only
        if its goodput beats plain decoding's by more than ``margin`` (relative), else K = 0."""
        best = max(self.ks(), key=lambda k: (self.goodput(b, k), -k))
        if best and self.goodput(b, best) <= (1.0 + margin) * self.goodput(b, 0):
            return 0
        return best

    def to_dict(self) -> dict:
        return {"costs": {str(b): {str(k): c for k, c in row.items()} for b, row in self.costs.items()},
                "acceptance": list(self.acceptance), "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "GoodputTable":
        try:
            return cls({int(b): {int(k): float(c) for k, c in row.items()} for b, row in d["costs"].items()},
                       [float(a) for a in d["acceptance"]], dict(d.get("meta") or {}))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a goodput table (needs 'costs' {{batch: {{K: seconds}}}} and 'acceptance'): {e}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "GoodputTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None


@dataclass
class BatchAwareLength:
    """Chain length per step from the live batch size (``choose(b)``), by the measured goodput table."""

    table: GoodputTable
    # speculate only where the measured gain over plain decoding exceeds this share: step costs measured
    # over a few short runs on a shared machine are noisy, and a wrong K > 0 loses where plain was as good
    margin: float = 0.05

    def __post_init__(self):
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")

    @property
    def max_len(self) -> int:
        return max(self.table.ks())

    def choose(self, batch_size: int) -> int:
        return self.table.best_k(batch_size, self.margin)

    def plan(self, batch_sizes: Sequence[int]) -> dict[int, int]:
        return {b: self.choose(b) for b in batch_sizes}


def calibrate(make_decoder: Callable[[int], Any], prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
              ks: Sequence[int], *, new_tokens: int = 16, repeats: int = 3,
              log: Callable[[str], None] | None = None) -> GoodputTable:
    """Measure cost(b, K) and acceptance on this machine with the batched decoder.

    ``make_decoder(k)`` builds a `BatchedSpeculativeDecoder` drafting chains of k (k = 0: plain). For
    every repeat, every batch size and every K in turn (interleaved), the first b prompts are decoded
    for ``new_tokens`` tokens; a cell's cost is the median step time over steps with all b rows live.
    Acceptance by depth comes from the runs with the largest K.
    """
    ks = sorted({int(k) for k in ks} | {0})
    if not prompts:
        raise ValueError("calibration needs prompts")
    if max(batch_sizes) > len(prompts):
        raise ValueError(f"calibration needs {max(batch_sizes)} prompts for batch size {max(batch_sizes)}, "
                         f"got {len(prompts)}")
    decs = {k: make_decoder(k) for k in ks}
    samples: dict[tuple[int, int], list[float]] = {}
    rows_kmax = []
    for k in ks:  # warm-up: allocation and first-call costs out of the timings
        decs[k].generate([list(p) for p in prompts[:1]], 2)
    for rep in range(repeats):
        for b in batch_sizes:
            for k in ks:
                res = decs[k].generate([list(p) for p in prompts[:b]], new_tokens, seed=rep)
                full = [s.draft_s + s.verify_s + s.other_s for s in res.steps if s.live == b]
                samples.setdefault((b, k), []).extend(full)
                if k == ks[-1]:
                    rows_kmax.extend(res.rows)
                if log:
                    log(f"calibrate rep {rep} b={b} K={k}: "
                        f"{statistics.median(full) * 1e3 if full else float('nan'):.1f}"
                        f" ms/step over {len(full)} steps, tau {res.tau:.2f}")
    costs: dict[int, dict[int, float]] = {}
    for (b, k), xs in samples.items():
        if xs:
            costs.setdefault(b, {})[k] = statistics.median(xs)
    acc = [a or 0.0 for a in acceptance_by_position(rows_kmax, max_depth=ks[-1])] if ks[-1] > 0 else []
    return GoodputTable(costs, acc, {"batch_sizes": list(batch_sizes), "ks": ks, "new_tokens": new_tokens,
                                     "repeats": repeats, "prompts": len(prompts)})
