"""Draft trees: their shapes, their attention masks, and the verification walk.

A draft tree's root (index 0) is the last emitted token, which the target has
not cached yet; drafted nodes follow in creation order, and every node's
children are stored in the order they were drawn (rank order). A chain is a
tree in which each node has one child, so chains and trees share one
verification path (`verify_tree`).

Shapes:
  * `StaticTree`: Medusa-style list of paths of ranks, e.g.
    ``[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]``; (0, 1) is the second-ranked
    child of the top-ranked first-level node.
  * `DynamicTree`: EAGLE-2-style, grown under a node budget from the draft's
    probabilities (docs/methods.md section 9); see drafting.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from draftsmith.engine.sampling import (SamplingParams, RandomSource, greedy_ids, verify_node, verify_node_certain,
                                      verify_node_greedy, verify_node_typical)


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape: paths of child ranks from the root."""

    paths: tuple[tuple[int, ...], ...]

    def __init__(self, paths: Iterable[Sequence[int]]):
        object.__setattr__(self, "paths", validate_paths(paths))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def size(self) -> int:
        return len(self.paths)

    def check_depth(self, max_depth: int | None) -> None:
        """Every path must fit the drafter (e.g. a Medusa model with K heads drafts depth <= K)."""
        if max_depth is None:
            return
        for p in self.paths:
            if len(p) > max_depth:
                raise ValueError(f"tree path {p} has depth {len(p)} but the drafter drafts at most {max_depth} tokens")


def validate_paths(paths: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Check a static tree and return it sorted by (depth, path); errors name the bad path.

    Rules: each path is a non-empty sequence of non-negative ints, no
    duplicates, every proper prefix is present, and sibling ranks are
    contiguous ((..., r) needs (..., r-1)): children are drawn in rank order
    without replacement, so a missing middle rank would make the next child's
    draft distribution unknown to verification.
    """
    out: list[tuple[int, ...]] = []
    for raw in paths:
        try:
            p = tuple(raw)
        except TypeError:
            raise ValueError(f"tree path {raw!r} is not a sequence of ranks") from None
        if not p:
            raise ValueError("tree path () is empty; the root is implicit")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in p):
            raise ValueError(f"tree path {p} has a rank that is not a non-negative int")
        out.append(p)
    if not out:
        raise ValueError("a static tree needs at least one path")
    seen = set()
    for p in out:
        if p in seen:
            raise ValueError(f"tree path {p} appears twice")
        seen.add(p)
    for p in out:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree path {p} has no parent path {p[:-1]} in the tree")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise ValueError(f"tree path {p} has rank {p[-1]} but its sibling {p[:-1] + (p[-1] - 1,)} "
                             f"is missing (ranks must be contiguous)")
    return tuple(sorted(out, key=lambda p: (len(p), p)))


def chain_paths(k: int) -> list[tuple[int, ...]]:
    """A chain of k drafted tokens as a static tree."""
    return [(0,) * i for i in range(1, k + 1)]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2-style tree grown from draft probabilities (drafting.grow_dynamic).

    budget: drafted nodes per step; max_depth: deepest node; width: most
    children per node; expand_batch: nodes added per drafter call (1 = exact
    best-first order; larger batches the drafter's work per depth).
    """

    budget: int = 16
    max_depth: int = 5
    width: int = 4
    expand_batch: int = 8

    def __post_init__(self):
        if min(self.budget, self.max_depth, self.width, self.expand_batch) < 1:
            raise ValueError(f"DynamicTree fields must all be >= 1, got {self}")

    @property
    def size(self) -> int:
        return self.budget


class DraftTree:
    """The drafted tree of one step. Node 0 is the root (the last emitted token)."""

    def __init__(self, root: int | torch.Tensor, capacity: int, device: torch.device | str):
        self.tok = torch.empty(capacity + 1, dtype=torch.long, device=device)
        self.tok[0] = root
        self._host: list[int | None] = [int(root) if isinstance(root, int) else None]
        self.parent: list[int] = [-1]
        self.depth: list[int] = [0]
        self.rank: list[int] = [0]
        self.children: list[list[int]] = [[]]
        # q[node]: the exact distribution node's children were drawn from (sampling only).
        self.q: dict[int, torch.Tensor] = {}
        # nodes whose children were proposed with certainty (model-free drafters): verified by
        # `verify_node_certain`, no q needed
        self.certain: set[int] = set()
        self.capacity = capacity

    @property
    def n(self) -> int:
        """Number of drafted nodes (the root excluded)."""
        return len(self.parent) - 1

    def add(self, parent: int, token: int | torch.Tensor) -> int:
        i = len(self.parent)
        if i > self.capacity:
            raise RuntimeError(f"draft tree over its capacity of {self.capacity} nodes")
        self.tok[i] = token
        self._host.append(int(token) if isinstance(token, int) else None)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.rank.append(len(self.children[parent]))
        self.children[parent].append(i)
        self.children.append([])
        return i

    def tokens(self) -> torch.Tensor:
        """[n + 1] token ids on the device, root first."""
        return self.tok[: self.n + 1]

    def host_tokens(self, extra: torch.Tensor | None = None) -> tuple[list[int], list[int] | None]:
        """Token ids on the host; ``extra`` (a device vector) rides along in the same transfer."""
        if all(t is not None for t in self._host) and extra is None:
            return list(self._host), None
        if extra is None:
            self._host = self.tokens().tolist()
            return list(self._host), None
        both = torch.cat([self.tokens(), extra.to(torch.long)]).tolist()
        self._host = both[: self.n + 1]
        return list(self._host), both[self.n + 1:]

    def path(self, i: int) -> list[int]:
        """Node indices from the root to ``i``."""
        out = [i]
        while self.parent[out[-1]] >= 0:
            out.append(self.parent[out[-1]])
        return out[::-1]

    def ancestor_mask(self, device: torch.device | str) -> torch.Tensor:
        """[n+1, n+1] bool: row i sees its ancestors and itself (tree attention)."""
        m = self.n + 1
        allowed = torch.zeros((m, m), dtype=torch.bool)
        for i in range(m):
            allowed[i, i] = True
            p = self.parent[i]
            if p >= 0:
                allowed[i] |= allowed[p]
        return allowed.to(device, non_blocking=True)

    def verify_rows(self, cached: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [pre + n + 1] and block [pre + n + 1, pre + n + 1] (bool) of a tree verification over the
        ``pre = length - cached`` uncached committed tokens (causal) followed by the root and the drafts
        (each sees every uncached committed token, its ancestors and itself)."""
        pre, m = length - cached, self.n + 1
        pos = torch.cat([torch.arange(cached, length, device=device),
                         length + torch.tensor(self.depth, device=device)])
        block = torch.zeros(pre + m, pre + m, dtype=torch.bool, device=device)
        block[:pre, :pre] = torch.ones(pre, pre, dtype=torch.bool, device=device).tril()
        block[pre:, :pre] = True
        block[pre:, pre:] = self.ancestor_mask(device)
        return pos, block

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parent) if i > 0)


@dataclass
class Verdict:
    """Outcome of verifying one draft tree."""

    path: list[int]  # accepted nodes, root (0) first
    tokens: list[int]  # emitted: accepted draft tokens, then the final token unless an EOS was accepted
    attempted: int  # depths along the accepted path at which at least one candidate was tested
    eos: bool = False
    accepted: int = field(init=False)

    def __post_init__(self):
        self.accepted = len(self.path) - 1


def verify_tree(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, rng: RandomSource,
                eos_ids: Iterable[int] = (), acceptance: str = "exact") -> Verdict:
    """Walk the tree from the root with the target's logits [n+1, V] at every node.

    Greedy: follow the child equal to the target's argmax. Sampling (exact):
    `verify_node` at each node with the q the children were drawn from, or
    `verify_node_certain` at a node whose children were proposed with certainty; the
    target's p is `processed_probs` of its logits, computed for visited
    nodes only. Nothing after an accepted EOS is emitted.
    """
    eos = set(int(e) for e in eos_ids)
    if sampling.greedy:
        toks, am = tree.host_tokens(extra=greedy_ids(logits))
    else:
        toks, am = tree.host_tokens()
    node, path, out, attempted = 0, [0], [], 0
    while True:
        kids = tree.children[node]
        kid_toks = [toks[k] for k in kids]
        attempted += bool(kids)
        if sampling.greedy:
            v = verify_node_greedy(am[node], kid_toks)
        else:
            p = sampling.probs(logits[node])
            if node in tree.certain:
                v = verify_node_certain(p, kid_toks, rng)
            elif acceptance == "typical":
                v = verify_node_typical(p, kid_toks, rng)
            else:
                v = verify_node(p, kid_toks, tree.q.get(node), rng)
        if v.child is None:
            out.append(int(v.token))
            return Verdict(path, out, attempted)
        node = kids[v.child]
        path.append(node)
        out.append(toks[node])
        if toks[node] in eos:
            return Verdict(path, out, attempted, eos=True)
