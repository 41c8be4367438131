"""``draftsmith data|cache|train|trees|report|bench RECIPE``, ``draftsmith run RECIPE`` (every stage in
order) and ``draftsmith quickstart`` (``run quickstart``): the stages of pipeline/stages.py, with what each
one prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from draftsmith.pipeline import stages as pipeline
from draftsmith.cli.shared import add_dtype_arg, recipe_from, target_of
from draftsmith.eval.bench import BASELINE, is_plain
from draftsmith.target import resolve_dtype

STAGES = ("data", "cache", "train", "trees", "report", "bench")
# Stages that read the target in float32 whatever the recipe's dtype: training (the drafter trains in fp32 on the
# cached features, and a Medusa head shares the target's LM head) and what reads the trained module against
# cached features (trees: held-out acceptance; report: held-out accuracy).
FP32_STAGES = ("train", "trees", "report")


def add_parser(subparsers, name: str, summary: str) -> None:
    """``name`` is a stage, ``run`` or ``quickstart``."""
    sp = subparsers.add_parser(name, help=summary)
    add_dtype_arg(sp, None, "the recipe's dtype, float32 unless it says otherwise; train, trees and report read "
                            "the target in float32 whatever this says")
    if name == "quickstart":
        sp.add_argument("overrides", nargs="*")
        sp.set_defaults(func=run, recipe="quickstart", stages=STAGES)
        return
    sp.add_argument("recipe", help="recipe YAML path or built-in name (quickstart, medusa-large)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=5e-4 or dtype=bfloat16")
    if name in ("train", "run"):
        sp.add_argument("--fresh", action="store_true", help="ignore existing checkpoints (no resume)")
    sp.set_defaults(func=run, stages=STAGES if name == "run" else (name,))


def _step_cost_line(tr: dict) -> str:
    """The trees stage's line on measured step costs (verification, and drafting where it was measured)."""
    dc = tr.get("draft_cost_ms")
    what = "verification + drafting" if dc else "verification"
    base = (f" of {tr['plain_step_ms']:.1f} ms; drafting {dc['fixed']:.1f} ms per step + {dc['per_depth']:.1f} ms "
            "per tree level") if dc else ""
    trees = ", ".join(f"{b} nodes (depth {max(map(len, t['paths']))}) x{t['step_cost']:.2f} -> "
                      f"{t['relative_speed']:.2f}x plain" for b, t in tr["trees"].items())
    return (f"measured step cost on this machine ({what} vs a 1-row forward{base}): {trees}; "
            f"best: built:{tr['best']} (--tree built:best)")


def run(args: argparse.Namespace) -> int:
    if int(os.environ.get("RANK", "0")) != 0:  # under a launcher only rank 0 talks
        sys.stdout = open(os.devnull, "w")
    recipe = recipe_from(args)
    recipe.out.mkdir(parents=True, exist_ok=True)
    (recipe.out / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json"), indent=2))
    (recipe.out / "command.txt").write_text(" ".join(sys.argv) + "\n")
    if recipe.shared_data:  # same data and cache for every recipe that names this directory
        shared = Path(recipe.shared_data)
        for sub in ("data", "cache"):
            (shared / sub).mkdir(parents=True, exist_ok=True)
            link = recipe.out / sub
            if link.is_symlink() and link.resolve() != (shared / sub).resolve():
                link.unlink()
            if not link.exists():
                link.symlink_to((shared / sub).resolve(), target_is_directory=True)
            elif not link.is_symlink():
                raise ValueError(f"{link} exists and is not a link to shared_data {shared}: move it away first")
    t_all = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    choice = resolve_dtype(recipe.dtype, device)
    if recipe.dtype == "auto":
        print(f"dtype auto: {choice.name} ({choice.reason})")
    decode = pipeline.decode_choice(recipe, device)  # the trees' step costs and the bench decode in this one
    if decode.name != choice.name and any(st in args.stages for st in ("trees", "bench")):
        print(f"decoding dtype (trees' step costs, bench): {decode.name} ({decode.reason})")
    loaded: dict[str, object] = {}

    def target_for(st: str, keep: bool = False):
        """The target in the recipe's dtype (data, cache), in float32 for `FP32_STAGES`, in the decoding dtype for
        the bench; loaded when a stage first needs that dtype (the other one is let go first, one copy in memory
        at a time, unless ``keep``)."""
        want = "float32" if st in FP32_STAGES else decode.name if st == "bench" else choice.name
        if want not in loaded:
            if st in FP32_STAGES and want != choice.name:
                print(f"{st}: the target in float32 (training reads it so; the recipe's dtype {choice.name} is "
                      f"for data and cache, {decode.name} for the trees' step costs and bench)")
            if not keep:
                loaded.clear()
            loaded[want] = target_of(recipe, want)
        return loaded[want]

    times = {}
    ckpt = recipe.out / "final"
    for st in args.stages:
        t0 = time.time()
        target = target_for(st)
        if st == "data":
            pipeline.stage_data(recipe, target)
            meta = json.loads((recipe.out / "data" / "meta.json").read_text())
            gen, held = meta.get("generation", {}), meta.get("heldout_generation", {})  # a merged set has no
            skipped = meta.get("skipped", {}).get("total", sum(r.get("skipped", {}).get("total", 0)  # run-level keys
                                                                for r in meta.get("runs", [])))
            print(f"data: {gen.get('conversations', 0)} conversations, {gen.get('response_tokens', 0)} response "
                  f"tokens; {meta.get('sources', {}).get('held_out_mtbench', 0)} MT-Bench questions removed from "
                  f"training sources, {held.get('conversations', 0)} MT-Bench answers held out; "
                  f"skipped {skipped} bad rows")
        elif st == "cache":
            res = pipeline.stage_cache(recipe, target)
            for split, idx in res.items():
                print(f"cache/{split}: {idx['tokens']} tokens, {idx['loss_tokens']} assistant tokens, "
                      f"{idx['bytes_per_token']:.0f} bytes/token on disk ({idx['dtype']}, needs {idx['needs']})")
        elif st == "train":
            ckpt, timing = pipeline.stage_train(recipe, target, resume=not getattr(args, "fresh", False))
            print(f"train: {timing['steps']} steps in {timing['wall_s']:.1f} s "
                  f"({timing['distributed_type']}, {timing['world_size']} process(es)); "
                  f"{100 * timing['outside_math_share']:.1f}% of wall time outside model math")
        elif st == "trees":
            # step costs measured in the dtype decoding runs in (kept loaded: bench reuses its compiled graphs)
            tr = pipeline.stage_trees(recipe, target, ckpt, cost_target=target_for("bench", keep=True))
            if "skipped" in tr:
                print(f"trees: {tr['skipped']}")
            else:
                kind = "held-out" if tr["source"].get("held_out", True) else "(NOT held-out: trained on)"
                print(f"trees from {tr['source']['sequences']} {kind} training sequences: " + ", ".join(
                    f"{b} nodes -> expected tau {t['expected_tau']:.2f}" for b, t in tr["trees"].items()) +
                    f" (chain K={len(tr['rank_acc'])}: {tr['chain_expected_tau'][str(len(tr['rank_acc']))]:.2f})")
                if "heldout" in tr:
                    print("the same trees on the held-out MT-Bench answers (the bench's prompts; a forecast, not "
                          "a choice): " + ", ".join(f"{b} nodes -> expected tau {t['heldout_expected_tau']:.2f}"
                                                    for b, t in tr["trees"].items()))
                warn = pipeline.forecast_warning(tr["source"])
                if warn:
                    print(warn)
            if "best" in tr:
                print(_step_cost_line(tr))
                if tr.get("pays") is False:
                    print("trees: no tree is expected to beat plain decoding on this machine with this drafter "
                          "(expected tau per step cost < 1); the bench stage measures it")
        elif st == "report":
            pipeline.stage_report(recipe, target, ckpt)
            print((recipe.out / "report.md").read_text())
        elif st == "bench":
            # plain decoding in the run's other dtype too (float32, or the data's dtype where decoding runs in float32):
            # the fastest plain decoding on this machine may be a dtype the drafters do not run in
            others = tuple(loaded[d] if d in loaded else target_of(recipe, d) for d in pipeline.plain_dtypes(
                recipe, decode.name, device, choice.name))
            b = pipeline.stage_bench(recipe, target, ckpt, plain_targets=others)
            print(f"decoding {b['prompts']} MT-Bench first turns, {b['max_new_tokens']} new tokens, greedy "
                  f"(interleaved, this machine; plain (ours) and the drafters in {b['dtype']}):")
            print(b["table"])
            si = b.get("suffix_index")
            if si:
                print(f"suffix index (SuffixDecoding's history, in {recipe.out / 'suffix_index'}): {si['replies']} "
                      f"answers, {si['indexed_tokens']} tokens from data/train.jsonl in {si['build_s']} s; skipped "
                      f"{sum(si['skipped'].values())} rows {si['skipped'] or ''}".rstrip())
            for m, f in b.get("forecast", {}).items():
                print(f"{m}: the trees stage forecast tau {f['forecast_tau']:.2f}"
                      + (f" and {f['forecast_speedup']:.2f}x our plain decoding" if "forecast_speedup" in f else "")
                      + f"; measured {f['measured_tau']:.2f}"
                      + (f" and {f['measured_speedup']:.2f}x" if "measured_speedup" in f else "")
                      + f" (tau {f['tau_ratio']:.2f} of the forecast"
                      + (f", speed {f['speedup_ratio']:.2f}" if "speedup_ratio" in f else "")
                      + (f": a step cost {f['measured_step_cost']:.2f} plain steps, forecast "
                         f"{f['forecast_step_cost']:.2f}; the prefill and the rest x{f['rest_ratio']:.2f}"
                         if "rest_ratio" in f else "") + ")"
                      + (f"; on the held-out MT-Bench answers it forecast tau {f['heldout_forecast_tau']:.2f} "
                         f"({f['heldout_tau_ratio']:.2f} of it measured)" if "heldout_tau_ratio" in f else ""))
            ms = b["methods"]
            plain = ms.get(BASELINE)
            drafted = {n: m for n, m in ms.items() if not is_plain(n)}
            if b.get("llamacpp"):
                print(f"llama.cpp: left out of the table ({b['llamacpp'].splitlines()[0]})")
            if plain and drafted:
                best = max(drafted, key=lambda n: drafted[n]["tokens_per_s"])
                hf = ms.get("HF generate")
                fw = b.get("forward", {})
                print(f"best: {best}, {drafted[best]['tokens_per_s']:.2f} tok/s = "
                      f"{drafted[best]['tokens_per_s'] / plain['tokens_per_s']:.2f}x our plain decoding "
                      f"in {b['dtype']} ({plain['tokens_per_s']:.2f} tok/s, {fw.get('forward', 'eager')} forward"
                      + (f", compiled in {fw['compile_s']:.0f} s" if fw.get("compile_s") else "")
                      + (f"; drafting compiled in {fw['drafter_compile_s']:.0f} s" if fw.get("drafter_compile_s")
                         else "") + ")"
                      + (f", {drafted[best]['tokens_per_s'] / hf['tokens_per_s']:.2f}x HF generate" if hf else ""))
                fastest = b.get("fastest_plain")
                if fastest and fastest != BASELINE:
                    print(f"the fastest plain decoding measured here is {fastest} ({ms[fastest]['tokens_per_s']:.2f} "
                          f"tok/s): the best drafter in our decoder is "
                          f"{drafted[best]['tokens_per_s'] / ms[fastest]['tokens_per_s']:.2f}x it")
        times[st] = round(time.time() - t0, 1)
    print(f"stage seconds: {times}; total {time.time() - t_all:.1f} s; outputs in {recipe.out}")
    return 0
