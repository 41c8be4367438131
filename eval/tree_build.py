"""Static draft trees built from measured acceptance (methods.md section 2).

``a[d][r]``: how often the r-th ranked candidate at depth d+1 is the right
token, measured on sequences held out of training (the calibration split):
  * Medusa: head d+1's rank-r accuracy (heads are independent, so a path's
    value is the product of its nodes' accuracies, the Medusa paper's model);
  * Hydra: head d+1 is teacher-forced on the true tokens t+1..t+d+1, so its
    rank-r accuracy is the acceptance of depth d+1 *given* its ancestors
    were accepted (per-depth conditional acceptance).
A path's expected value is the product along it; a tree's expected accepted
length is 1 + the sum over its nodes. Growth is greedy under a node budget:
from the root, repeatedly add the frontier node (next sibling of a node in
the tree, or first child of one) with the highest value. Siblings enter in
rank order, so every tree is a valid `StaticTree`.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

TREES = "trees.json"


def grow_tree(acc: list[list[float]], budget: int) -> tuple[list[tuple[int, ...]], float]:
    """(paths, expected tokens per step) of the greedy tree with ``budget`` nodes (root excluded)."""
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1, got {budget}")
    if not acc or not acc[0]:
        raise ValueError("no acceptance figures to build a tree from")
    depth, ranks = len(acc), len(acc[0])
    heap: list[tuple[float, tuple[int, ...]]] = [(-acc[0][0], (0,))]
    paths: list[tuple[int, ...]] = []
    value: dict[tuple[int, ...], float] = {(): 1.0}
    while heap and len(paths) < budget:
        neg, p = heapq.heappop(heap)
        v = -neg
        paths.append(p)
        value[p] = v
        d, r = len(p), p[-1]
        parent = value[p[:-1]]
        if r + 1 < ranks:  # next sibling
            heapq.heappush(heap, (-(parent * acc[d - 1][r + 1]), p[:-1] + (r + 1,)))
        if d < depth:  # first child
            heapq.heappush(heap, (-(v * acc[d][0]), p + (0,)))
    return paths, 1.0 + sum(value[p] for p in paths)


def chain_value(acc: list[list[float]], length: int) -> float:
    """Expected tokens per step of a top-1 chain of ``length`` under the same model."""
    out, run = 1.0, 1.0
    for d in range(min(length, len(acc))):
        run *= acc[d][0]
        out += run
    return out


def tree_value(acc: list[list[float]], paths: list[tuple[int, ...]]) -> float:
    """Expected tokens per step of any static tree (paths of ranks) under the same model."""
    out = 1.0
    for p in paths:
        v = 1.0
        for d, r in enumerate(p):
            v *= acc[d][r] if d < len(acc) and r < len(acc[d]) else 0.0
        out += v
    return out


def build_trees(rank_acc: list[list[float]], budgets: list[int], source: dict) -> dict:
    """Trees for each budget, with the figures they were built from."""
    out = {"rank_acc": rank_acc, "source": source, "trees": {}}
    for b in budgets:
        paths, ev = grow_tree(rank_acc, b)
        out["trees"][str(b)] = {"paths": [list(p) for p in paths], "expected_tau": ev}
    out["chain_expected_tau"] = {str(k): chain_value(rank_acc, k) for k in range(1, len(rank_acc) + 1)}
    return out


def save_trees(ckpt: str | Path, trees: dict) -> Path:
    p = Path(ckpt) / TREES
    p.write_text(json.dumps(trees, indent=1))
    return p


def load_tree(ckpt: str | Path, budget: int | str) -> list[tuple[int, ...]]:
    """The built tree of ``budget`` nodes saved with a checkpoint."""
    p = Path(ckpt) / TREES
    if not p.exists():
        raise FileNotFoundError(f"{ckpt} has no built trees ({TREES}); run `draftsmith trees` on it first")
    trees = json.loads(p.read_text())["trees"]
    if str(budget) not in trees:
        have = sorted(trees, key=int)
        raise ValueError(f"{ckpt} has built trees for budgets {have}, not {budget}; build it with "
                         f"`draftsmith trees RECIPE 'train.tree_budgets=[{', '.join(have + [str(budget)])}]'`")
    return [tuple(x) for x in trees[str(budget)]["paths"]]
