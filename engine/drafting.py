"""Growing one step's draft tree: chains, static trees, dynamic trees.

Every grower asks the drafter for the children's logits of a contiguous
range of tree nodes (``propose(tree, start, end)``) and picks children:
  * ranked mode (greedy, or the lossy typical acceptance): the top-ranked
    tokens of the draft logits;
  * sampled mode: draws WITHOUT replacement from q = `processed_probs` of the
    draft logits, and stores that exact q on the tree for verification.

Dynamic trees (EAGLE-2 style) add nodes best-first by value, value = product
of draft probabilities along the path, under a node budget. The value of a
candidate is computed before it is drawn: the rank-r child of node n is
worth value(n) * (r-th largest probability of n's draft distribution). Under
greedy this is exactly the product of the drawn tokens' probabilities; under
sampling it does not depend on which token the draw produces, which is what
keeps the tree lossless: whether a node exists never depends on its own
token, only on its ancestors and on earlier siblings (tested by exact
enumeration in tests/test_decoder_enumeration.py).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch

from draftsmith.engine.policies import DraftSignal, LengthPolicy
from draftsmith.engine.sampling import RandomSource, SamplingParams, WithoutReplacement, greedy_ids
from draftsmith.engine.trees import DraftTree, DynamicTree, StaticTree

Propose = Callable[[DraftTree, int, int], "torch.Tensor | None"]


@dataclass
class GrowContext:
    propose: Propose  # logits [end - start, V] for the children of nodes [start, end), or None
    sampling: SamplingParams
    ranked: bool  # top-ranked candidates (greedy / typical) instead of draws from q
    rng: RandomSource
    eos: frozenset[int]
    depth_cap: int  # deepest node allowed this step
    features: Callable[[], object] | None = None  # drafter features for length policies
    # the drafter proposes for any node range independently (heads: no per-node state), so a static tree's level
    # asks only for the range spanning the nodes that get children, not for every node of the level above
    any_range: bool = False

    def q(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        return s.probs(logits)


def grow_chain(tree: DraftTree, ctx: GrowContext, policy: LengthPolicy) -> None:
    """Draft one token at a time while the policy agrees (at most ``policy.max_len``)."""
    node = 0
    stop_after = getattr(policy, "stop_after", None)  # optional (policies.py): draft this token, then stop
    for depth in range(min(ctx.depth_cap, policy.max_len)):
        lg = ctx.propose(tree, node, node + 1)
        if lg is None:
            return
        row = lg[0]
        q = None if ctx.ranked else ctx.q(row)
        feats = ctx.features() if ctx.features is not None else None
        signal = DraftSignal(depth, row, q, feats)
        if not policy.should_continue(signal):
            return
        if ctx.ranked:
            tok = greedy_ids(row)  # stays on the device: no host sync
            node = tree.add(node, tok)
            if stop_after is not None and stop_after(signal, tok):
                return
            continue
        tok = ctx.rng.categorical(q)
        tree.q[node] = q
        node = tree.add(node, tok)
        if stop_after is not None and stop_after(signal, tok):
            return
        if tok in ctx.eos:
            return


def grow_static(tree: DraftTree, ctx: GrowContext, shape: StaticTree) -> None:
    """Realise a static tree depth by depth, one drafter call per depth.

    Under sampling a node's m children are m draws without replacement; if
    q's support runs out first, the missing ranks and their subtrees are
    dropped. Nodes at one depth are contiguous in the tree (breadth-first).
    """
    kids: dict[tuple[int, ...], int] = {}
    for p in shape.paths:
        kids[p[:-1]] = kids.get(p[:-1], 0) + 1
    where: dict[tuple[int, ...], int] = {(): 0}
    for depth in range(1, min(shape.depth, ctx.depth_cap) + 1):
        parents = sorted(((where[pp], pp) for pp in kids if len(pp) == depth - 1 and pp in where))
        # An EOS node ends the answer: drafting below it is wasted (token known only when sampled).
        parents = [(i, pp) for i, pp in parents if i == 0 or tree._host[i] is None or tree._host[i] not in ctx.eos]
        if not parents:
            return
        if ctx.any_range:
            lo, hi = parents[0][0], parents[-1][0]
        else:
            lo = min(i for i, d in enumerate(tree.depth) if d == depth - 1)
            hi = max(i for i, d in enumerate(tree.depth) if d == depth - 1)
        lg = ctx.propose(tree, lo, hi + 1)
        if lg is None:
            return
        for i, pp in parents:
            row, m = lg[i - lo], min(kids[pp], lg.shape[-1])
            if ctx.ranked:
                for r, tok in enumerate(torch.topk(row, m).indices):
                    where[pp + (r,)] = tree.add(i, tok)
                continue
            q = ctx.q(row)
            tree.q[i] = q
            draw = WithoutReplacement(q, ctx.rng)
            for r in range(m):
                tok = draw.next()
                if tok is None:
                    break
                where[pp + (r,)] = tree.add(i, tok)


def grow_dynamic(tree: DraftTree, ctx: GrowContext, shape: DynamicTree) -> None:
    """Best-first growth under a node budget (see the module docstring for the value rule)."""
    cap = min(shape.max_depth, ctx.depth_cap)
    if cap < 1:
        return
    lg = ctx.propose(tree, 0, 1)
    if lg is None:
        return
    value = {0: 1.0}
    probs: dict[int, list[float]] = {}  # sorted candidate probabilities per expanded node
    choose: dict[int, object] = {}  # ranked: token list; sampled: WithoutReplacement
    heap: list[tuple[float, int, int, int]] = []
    counter = 0

    def expand(first: int, rows: torch.Tensor) -> None:
        nonlocal counter
        nodes = [i for i in range(first, first + rows.shape[0])
                 if tree.depth[i] < cap and (tree._host[i] is None or tree._host[i] not in ctx.eos)]
        if not nodes:
            return
        sel = rows[[i - first for i in nodes]]
        w = min(shape.width, sel.shape[-1])
        if ctx.ranked:
            conf = torch.softmax(sel.float(), dim=-1)
        else:
            conf = ctx.q(sel)
            for j, i in enumerate(nodes):
                tree.q[i] = conf[j]
                choose[i] = WithoutReplacement(conf[j], ctx.rng)
        top = torch.topk(conf, w, dim=-1)
        vals, idx = top.values.tolist(), top.indices.tolist()  # one transfer per round
        for j, i in enumerate(nodes):
            probs[i] = vals[j]
            if ctx.ranked:
                choose[i] = idx[j]
            if vals[j][0] > 0.0:
                heapq.heappush(heap, (-value[i] * vals[j][0], counter, i, 0))
                counter += 1

    expand(0, lg)
    while heap and tree.n < shape.budget:
        first = tree.n + 1
        for _ in range(shape.expand_batch):
            if not heap or tree.n >= shape.budget:
                break
            negv, _, parent, r = heapq.heappop(heap)
            tok = choose[parent][r] if ctx.ranked else choose[parent].next()
            if tok is None:
                continue
            node = tree.add(parent, tok)
            value[node] = -negv
            nxt = probs[parent][r + 1] if r + 1 < len(probs[parent]) else 0.0
            if nxt > 0.0 and not math.isnan(nxt):
                heapq.heappush(heap, (-value[parent] * nxt, counter, parent, r + 1))
                counter += 1
        if tree.n >= first and tree.n < shape.budget and any(tree.depth[i] < cap for i in range(first, tree.n + 1)):
            lg = ctx.propose(tree, first, tree.n + 1)
            if lg is None:
                return
            expand(first, lg)
