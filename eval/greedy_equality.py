"""Greedy equality with plain decoding on MT-Bench, divergences explained by near-ties.

Greedy speculative decoding must reproduce plain greedy decoding token for
token, up to numerical ties: a tree or chain forward computes the same
logits as a one-token forward only up to float rounding, so where the
target's top-2 logits are closer than ``tie_gap`` the argmax may flip. Every
divergence is located and its top-2 gap (in plain decoding's context) is
reported; a divergence that is not at a near-tie is a bug.

Script (all 80 first turns, 128 new tokens; long on a CPU):
    python -m draftsmith.eval.greedy_equality --drafter-layers 8 --out greedy.json
On a 2-core CPU, two one-thread shards and a merge finish in about half the time:
    OMP_NUM_THREADS=1 python -m draftsmith.eval.greedy_equality --shard 0/2 --out g0.json &
    OMP_NUM_THREADS=1 python -m draftsmith.eval.greedy_equality --shard 1/2 --out g1.json; wait
    python -m draftsmith.eval.greedy_equality --merge g0.json g1.json --out greedy.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.drafters.suffix import HybridDrafter, PromptLookupDrafter, SuffixDrafter, SuffixIndex
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import add_forward_arg, use_fast_forward
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.tree_build import parse_tree
from draftsmith.engine.trees import DynamicTree
from draftsmith.eval.mtbench import Prompt, mtbench_prompts
from draftsmith.target import default_device, load_target

def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def top2(target, context: list[int]) -> tuple[float, float]:
    """(gap between the target's two largest next-token logits after ``context``, the largest), from a
    cache-free forward in the target's dtype."""
    dev = next(target.model.parameters()).device
    logits = target.model(torch.tensor([context], device=dev)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]), float(top[0])


def top2_gap(target, context: list[int]) -> float:
    """Gap between the target's two largest next-token logits after ``context`` (cache-free forward)."""
    return top2(target, context)[0]


#: in a low-precision dtype a gap of this many units in the last place of the top logit is a tie
TIE_ULPS = 4


def tie_threshold(top1: float, dtype: torch.dtype, tie_gap: float = 1e-3) -> float:
    """The top-2 gap under which a greedy divergence is a near-tie: ``tie_gap``, or ``TIE_ULPS`` units in the
    last place of the top logit in ``dtype`` when that is larger. fp32: 1e-3 (an ulp is ~1e-6). bf16: the logits
    come out of the LM head rounded to 8 significant bits (an ulp of a logit near 6 is 0.03), and a 1-row and a
    many-row forward may round the states under them differently, so gaps of an ulp or two flip."""
    if not dtype.is_floating_point or abs(top1) == 0.0:
        return tie_gap
    ulp = 2.0 ** math.floor(math.log2(abs(top1))) * torch.finfo(dtype).eps
    return max(tie_gap, TIE_ULPS * ulp)


def greedy_equality(target, methods: dict, prompts: list, max_new_tokens: int = 128,
                    tie_gap: float = 1e-3) -> dict:
    """Run plain greedy and every method on every prompt; count and explain divergences.

    A divergence is explained when the target's top-2 gap there is under `tie_threshold` (``tie_gap`` in fp32,
    a few ulps of the top logit in bf16/fp16): greedy equality holds in the target's dtype up to near-ties."""

    plain = SpeculativeDecoder(target)
    dtype = next(target.model.parameters()).dtype
    report = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "tie_gap": tie_gap,
              "dtype": str(dtype).removeprefix("torch."), "methods": {}}
    for name in methods:
        report["methods"][name] = {"equal": 0, "divergences": [], "unexplained": 0}
    t0 = time.perf_counter()
    for k, pr in enumerate(prompts):
        ref = plain.generate(pr.ids, max_new_tokens).tokens
        for name, dec in methods.items():
            out = dec.generate(pr.ids, max_new_tokens).tokens
            m = report["methods"][name]
            i = first_divergence(ref, out)
            if i is None:
                m["equal"] += 1
                continue
            gap, top1 = top2(target, pr.ids + ref[:i]) if i < len(ref) else (float("nan"), 0.0)
            limit = tie_threshold(top1, dtype, tie_gap)
            near_tie = gap < limit
            m["divergences"].append({"question_id": pr.question_id, "position": i, "top2_gap": gap,
                                     "tie_threshold": limit, "near_tie": near_tie})
            m["unexplained"] += 0 if near_tie else 1
        print(f"[{k + 1}/{len(prompts)}] " + " ".join(
            f"{n}: {m['equal']} equal, {len(m['divergences'])} diverged ({m['unexplained']} unexplained)"
            for n, m in report["methods"].items()), flush=True)
    report["seconds"] = time.perf_counter() - t0
    report["pass"] = all(m["unexplained"] == 0 for m in report["methods"].values())
    return report


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n; anything else is an error naming the value."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/n (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: need 0 <= i < n")
    return i, n


def merge_reports(reports: list[dict]) -> dict:
    """One report from shard reports of the same settings: counts added, divergences concatenated.

    Shards must cover disjoint prompts with the same methods, token budget and tie gap; the merged
    ``seconds`` is the longest shard's wall time (shards run side by side)."""
    if not reports:
        raise ValueError("nothing to merge")
    keys = ("max_new_tokens", "tie_gap", "dtype")
    for r in reports[1:]:
        for k in keys:
            if r.get(k) != reports[0].get(k):
                raise ValueError(f"cannot merge shards with different {k}: {r.get(k)} vs {reports[0].get(k)}")
        if set(r["methods"]) != set(reports[0]["methods"]):
            raise ValueError(f"cannot merge shards with different methods: {sorted(r['methods'])} vs "
                             f"{sorted(reports[0]['methods'])}")
    shards = [r.get("shard") for r in reports]
    if None not in shards and len({tuple(s) for s in shards}) != len(shards):
        raise ValueError(f"the same shard appears twice: {shards}")
    out = {k: reports[0][k] for k in keys if k in reports[0]}  # reports before the dtype choice have none
    out["prompts"] = sum(r["prompts"] for r in reports)
    out["shards"] = shards
    out["methods"] = {}
    for name in reports[0]["methods"]:
        ms = [r["methods"][name] for r in reports]
        out["methods"][name] = {"equal": sum(m["equal"] for m in ms),
                                "divergences": [d for m in ms for d in m["divergences"]],
                                "unexplained": sum(m["unexplained"] for m in ms)}
    out["seconds"] = max(r["seconds"] for r in reports)
    out["pass"] = all(m["unexplained"] == 0 for m in out["methods"].values())
    if "cpu_layout" in reports[0]:
        out["cpu_layout"] = reports[0]["cpu_layout"]
    return out


def _summary(report: dict) -> None:
    print(json.dumps({n: {k: v for k, v in m.items() if k != "divergences"} for n, m in report["methods"].items()}))
    print("PASS" if report["pass"] else "FAIL: divergences away from near-ties")


def main(argv: list[str] | None = None) -> dict:

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--checkpoint", default=None,
                    help="a trained head drafter to test with a static and a dynamic tree")
    ap.add_argument("--drafter-layers", type=int, default=8)
    ap.add_argument("--tree", action="append", default=None,
                    help="with --checkpoint: also its drafter with this tree (chain-free spec as for `eval --tree`; "
                         "method name 'heads-tree SPEC'); repeatable")
    ap.add_argument("--suffix", action="store_true",
                    help="also SuffixDecoding (its global index learning from every earlier answer), prompt lookup "
                         "and, with --checkpoint, the hybrid of its drafter (with the first --tree) and SuffixDecoding")
    ap.add_argument("--suffix-index", default=None, metavar="DIR",
                    help="with --suffix: SuffixDecoding starts from this saved global index (a run's suffix_index)")
    ap.add_argument("--second-turns", default=None, metavar="JSON",
                    help="prompts from a benchmarks.suffix_bench traffic.json (its 'greedy' prompts) instead of "
                         "MT-Bench first turns")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="subset of: chain static-tree dynamic-tree heads-chain heads-static-tree heads-dynamic-tree "
                         "(with --suffix: suffix prompt-lookup heads+suffix)")
    ap.add_argument("--no-cpu-layout", dest="cpu_layout", action="store_false",
                    help="keep PyTorch's default weight layout (default on CPU: draftsmith.engine.cpu_layout, as eval)")
    ap.add_argument("--shard", default=None, help="i/n: only prompts i, i+n, i+2n, ... (run n of these, then --merge)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge shard reports into one (written to --out); runs nothing else")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    add_forward_arg(ap)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"), default="float32",
                    help="the target's dtype: greedy equality is checked in it (docs/methods.md)")
    a = ap.parse_args(argv)
    if a.merge:
        reports = []
        for path in a.merge:
            with open(path) as f:
                reports.append(json.load(f))
        report = merge_reports(reports)
        _summary(report)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=2)
        return report
    shard = parse_shard(a.shard) if a.shard else None
    target = load_target(a.target, dtype=a.dtype, device=default_device(a.device))
    print(f"target forward: {use_fast_forward(target, a.forward)}")
    layers = first_layers_drafter(target, a.drafter_layers)
    methods = {
        "chain": SpeculativeDecoder(target, layers),
        "static-tree": SpeculativeDecoder(target, layers, tree=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
        "dynamic-tree": SpeculativeDecoder(target, layers, tree=DynamicTree(budget=8, max_depth=4, width=3)),
    }
    if a.checkpoint:
        heads = drafter_from_checkpoint(a.checkpoint, target)
        methods["heads-chain"] = SpeculativeDecoder(target, heads)
        for spec in a.tree or []:  # the checkpoint's drafter with a tree of your choice
            methods[f"heads-tree {spec}"] = SpeculativeDecoder(target, heads, tree=parse_tree(spec, a.checkpoint))
        if capabilities(heads).supports_trees:  # chain-only kinds are checked on their chain
            methods["heads-static-tree"] = SpeculativeDecoder(
                target, heads, tree=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])
            methods["heads-dynamic-tree"] = SpeculativeDecoder(target, heads,
                                                               tree=DynamicTree(16, heads.max_depth or 4, 4))
    if a.suffix:
        def suffix() -> SuffixDrafter:  # each method its own global index: empty, or the saved one
            return SuffixDrafter(index=SuffixIndex.load(a.suffix_index, fingerprint=target.fingerprint)
                                 if a.suffix_index else None)
        methods["suffix"] = SpeculativeDecoder(target, suffix())
        methods["prompt-lookup"] = SpeculativeDecoder(target, PromptLookupDrafter())
        if a.checkpoint:
            tree = parse_tree(a.tree[0], a.checkpoint) if a.tree else None  # the first --tree, else a chain
            methods["heads+suffix"] = SpeculativeDecoder(target, HybridDrafter(heads, suffix()), tree=tree)
    if a.methods:
        unknown = sorted(set(a.methods) - set(methods))
        if unknown:
            raise SystemExit(f"unknown or unavailable methods {unknown}; available: {sorted(methods)}")
        methods = {k: v for k, v in methods.items() if k in a.methods}
    if a.cpu_layout:
        drafters = {id(d.drafter): d.drafter for d in methods.values() if d.drafter is not None}
        print("CPU decoding layout:", apply_cpu_layout(target, *drafters.values()))
    prompts = mtbench_prompts(target.tokenizer, a.prompts)
    if a.second_turns:
        with open(a.second_turns) as f:
            rows = json.load(f)["greedy"][: a.prompts]
        prompts = [Prompt(i, r.get("group", "traffic"), "", r["prompt_ids"]) for i, r in enumerate(rows)]
    if shard:
        prompts = prompts[shard[0]::shard[1]]
    report = greedy_equality(target, methods, prompts, a.max_new_tokens)
    if shard:
        report["shard"] = list(shard)
    _summary(report)
    if a.out:
        report["cpu_layout"] = a.cpu_layout
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
