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
import time
from pathlib import Path

import torch

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.drafters import project
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.trees import DynamicTree, StaticTree

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


@torch.no_grad()
def measure_step_cost(target, sizes: list[int], prefix: int = 256, repeats: int = 21,
                      medians_out: dict | None = None) -> dict[str, float]:
    """Wall time of a verification forward over n drafted nodes (n + 1 rows, logits included) after a
    cached prefix, relative to plain decoding's 1-row forward, on this machine: the median over ``repeats``
    rounds of each round's ratio (every size timed once a round, back to back, so that the machine's speed,
    which drifts by 20-30% within minutes on a shared host, cancels out of each ratio; a ratio of medians taken
    apart did not: docs/results-log.md §39.4). Measure with the layout decoding will use
    (`draftsmith.engine.cpu_layout`).

    What a node costs depends on the hardware: on a GPU 64 rows cost about what 1 costs, on a 2-core
    CPU each row adds a share. Trees are then ranked by expected tokens per unit of step time.
    """
    model, dev = target.model, next(target.model.parameters()).device
    body, head = model.get_decoder(), model.get_output_embeddings()
    fast = getattr(target, "fast_body", None)  # the forward decoding will use (engine/fastpath.py)
    n_max = max(sizes) + 1
    if fast is not None:
        for n in [1] + [b + 1 for b in sizes]:
            fast.reserve(n)
    # a compiled forward compiles per cache capacity: measure on the 512 slots decoders use for short prompts
    cache = KVCache.for_model(model, max(512, 1 << (prefix + n_max - 1).bit_length()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, prefix + n_max), generator=g).to(dev)
    cache.set_write(0)
    body(input_ids=ids[:, :prefix], position_ids=torch.arange(prefix, device=dev)[None], **cache_arg(body, cache),
         use_cache=True)

    def once(n: int) -> float:
        m = prefix_block_mask(prefix, torch.ones(n, n, dtype=torch.bool, device=dev).tril(),
                              next(model.parameters()).dtype)
        cache.set_write(prefix)
        t0 = time.perf_counter()
        pos = torch.arange(prefix, prefix + n, device=dev)[None]
        if fast is not None:
            # its own storage, as the decoder's ids: a view at offset 256 made the compiled graph guard on the offset
            # and the decoder's next call compile again (15 s inside a timed run, docs/results-log.md §52)
            fast(input_ids=ids[:, prefix:prefix + n].clone(), position_ids=pos, attention_mask=m, cache=cache)
        else:
            h = body(input_ids=ids[:, prefix:prefix + n], position_ids=pos, attention_mask=m,
                     **cache_arg(body, cache), use_cache=True).last_hidden_state[0]
            project(head, h)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    ns = [1] + [b + 1 for b in sizes]
    times: dict[int, list[float]] = {n: [] for n in ns}
    for n in ns:
        once(n)
    for _ in range(repeats):  # sizes interleaved, so a noisy moment hits them all; median of each
        for n in ns:
            times[n].append(once(n))
    med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    if medians_out is not None:  # rows -> median seconds, for reports
        medians_out.update(med)

    def ratio(n: int) -> float:
        r = sorted(a / b for a, b in zip(times[n], times[1]))
        return r[len(r) // 2]
    return {str(b): ratio(b + 1) for b in sizes}


@torch.no_grad()
def measure_draft_cost(target, drafter, depth: int, *, prompt_len: int = 64, new_tokens: int = 40,
                       seed: int = 0) -> dict[str, float]:
    """What drafting costs per step, in seconds: ``fixed`` (once per step, e.g. Hydra++'s prefix layer) and
    ``per_depth`` (one drafter call per level of the tree), from the median draft time per step of two greedy
    chains decoded on a random prompt: one token (fixed + 1 call) and ``depth`` tokens (fixed + depth calls).
    Measured in decoding as it runs (the target's forward between drafts, with the forward and dtype decoding
    uses), so a drafter whose weights the target's forward evicts from the caches is charged for reading them
    again."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.vocab_size, (prompt_len,), generator=g).tolist()
    med = {}
    for k in sorted({1, max(1, depth)}):
        dec = SpeculativeDecoder(target, drafter, policy=FixedLength(k))
        dec.generate(prompt, 8)  # compiles what this chain uses
        times = [s.draft_s for s in dec.generate(prompt, new_tokens).steps if s.drafted == k]
        med[k] = sorted(times)[len(times) // 2] if times else 0.0
    per = max((med[depth] - med[1]) / (depth - 1), 0.0) if depth > 1 else med[1]
    return {"fixed": max(med[1] - per, 0.0), "per_depth": per}


def tree_depth(paths) -> int:
    return max((len(p) for p in paths), default=0)


def build_trees(rank_acc: list[list[float]], budgets: list[int], source: dict,
                step_cost: dict[str, float] | None = None, draft_cost: dict[str, float] | None = None) -> dict:
    """Trees for each budget, with the figures they were built from.

    With ``step_cost`` (budget -> verification time relative to a 1-row forward, `measure_step_cost`)
    each tree also gets ``relative_speed`` = expected tau / step cost, the tokens/s it should give over
    plain decoding, and ``best`` names the budget with the highest. With ``draft_cost`` too (``fixed`` and
    ``per_depth``, relative to the same 1-row forward: `measure_draft_cost` divided by it) the step cost of a
    tree is its verification plus its drafting (fixed + one call per level), and each budget's tree is the
    best of the greedy trees limited to depth 1, 2, ... (a deeper tree drafts more calls per step); where
    no tree's expected speed reaches plain decoding's (1.0), ``pays`` is false.
    """
    out = {"rank_acc": rank_acc, "source": source, "trees": {}}
    if draft_cost:
        out["draft_cost"] = dict(draft_cost)
    for b in budgets:
        paths, ev = grow_tree(rank_acc, b)
        tree = {"paths": [list(p) for p in paths], "expected_tau": ev}
        if step_cost and str(b) in step_cost:
            verify = step_cost[str(b)]
            tree.update(step_cost=verify, relative_speed=ev / verify)
            if draft_cost:
                def cost(ps):
                    return verify + draft_cost["fixed"] + draft_cost["per_depth"] * tree_depth(ps)
                cands = [grow_tree(rank_acc[:d], b) for d in range(1, len(rank_acc) + 1)]
                paths, ev = max(cands, key=lambda c: c[1] / cost(c[0]))
                tree = {"paths": [list(p) for p in paths], "expected_tau": ev, "step_cost": cost(paths),
                        "verify_cost": verify, "relative_speed": ev / cost(paths)}
        out["trees"][str(b)] = tree
    out["chain_expected_tau"] = {str(k): chain_value(rank_acc, k) for k in range(1, len(rank_acc) + 1)}
    ranked = [b for b in out["trees"] if "relative_speed" in out["trees"][b]]
    if ranked:
        out["best"] = max(ranked, key=lambda b: out["trees"][b]["relative_speed"])
        if draft_cost:
            out["pays"] = out["trees"][out["best"]]["relative_speed"] > 1.0
    return out


def add_heldout_forecast(trees: dict, rank_acc: list[list[float]], source: dict) -> dict:
    """The built trees' expected tau again, from acceptance measured on another held-out set (the bench's own
    distribution: MT-Bench first turns and the target's answers), beside the forecast from the calibration split
    (the training data's distribution). The trees stay those the calibration split built: this set only
    forecasts, it never chooses. Adds ``heldout`` (its acceptance and where it came from), per tree
    ``heldout_expected_tau`` and, where the step cost was measured, ``heldout_relative_speed``, and
    ``chain_heldout_expected_tau``."""
    trees["heldout"] = {"rank_acc": rank_acc, **source}
    for t in trees["trees"].values():
        tau = tree_value(rank_acc, [tuple(p) for p in t["paths"]])
        t["heldout_expected_tau"] = tau
        if "step_cost" in t:
            t["heldout_relative_speed"] = tau / t["step_cost"]
    trees["chain_heldout_expected_tau"] = {str(k): chain_value(rank_acc, k) for k in range(1, len(rank_acc) + 1)}
    return trees


def save_trees(ckpt: str | Path, trees: dict) -> Path:
    p = Path(ckpt) / TREES
    p.write_text(json.dumps(trees, indent=1))
    return p


def load_tree(ckpt: str | Path, budget: int | str) -> list[tuple[int, ...]]:
    """The built tree of ``budget`` nodes saved with a checkpoint."""
    p = Path(ckpt) / TREES
    if not p.exists():
        raise FileNotFoundError(f"{ckpt} has no built trees ({TREES}); run `draftsmith trees` on it first")
    saved = json.loads(p.read_text())
    trees = saved["trees"]
    if str(budget) == "best":
        if "best" not in saved:
            raise ValueError(f"{ckpt}'s trees were built without measured step costs; rebuild them with "
                             f"`draftsmith trees RECIPE` to use built:best")
        budget = saved["best"]
    if str(budget) not in trees:
        have = sorted(trees, key=int)
        raise ValueError(f"{ckpt} has built trees for budgets {have}, not {budget}; build it with "
                         f"`draftsmith trees RECIPE 'train.tree_budgets=[{', '.join(have + [str(budget)])}]'`")
    return [tuple(x) for x in trees[str(budget)]["paths"]]


def parse_tree(spec: str, checkpoint=None):
    """``chain`` | ``built:BUDGET`` (the checkpoint's tree built from measured acceptance) |
    ``dynamic[:BUDGET[,DEPTH[,WIDTH]]]`` | JSON list of rank paths | path to such a JSON file."""
    s = spec.strip()
    if s == "chain":
        return None
    if s.startswith("built:"):
        if checkpoint is None:
            raise ValueError(f"--tree {spec!r} needs a checkpoint with built trees")
        return StaticTree(load_tree(checkpoint, s.split(":", 1)[1]))
    if s.startswith("dynamic"):
        nums = [int(x) for x in s.split(":", 1)[1].split(",")] if ":" in s else []
        keys = ["budget", "max_depth", "width"]
        return DynamicTree(**dict(zip(keys, nums)))
    if Path(s).is_file():
        s = Path(s).read_text()
    try:
        paths = json.loads(s)
    except json.JSONDecodeError:
        raise ValueError(f"--tree {spec!r}: expected 'chain', 'dynamic[:B,D,W]', a JSON list of paths or a "
                         f"JSON file") from None
    return StaticTree([tuple(p) for p in paths])
