"""What drafting costs per step with each drafting path, measured side by side in one interleaved run.

    python -m benchmarks.draft_cost --checkpoint runs/quickstart/final [--tree built:best] [--prompts 8]
        [--max-new-tokens 64] [--threads 2] [--dtype bfloat16] [--out FILE]

The same Hydra, EAGLE-3 or DFlash checkpoint decodes MT-Bench first turns on the compiled target forward
(engine/fastpath.py) with its drafting done three ways: eager (Hydra's heads with the CPU decoding layout),
compiled with the drafter's own weights, and compiled with int8 weights (heads/hydra/fast.py,
drafters/eagle3/fast.py, drafters/dflash/fast.py; int8 is the default on CPU in bf16); plus plain decoding. For a
checkpoint without built trees, give ``--tree`` as a list of paths or ``chain``.
Printed per method: draft and verification ms per step, tau, tok/s and the ratio to plain decoding; the
methods run in turn on every prompt (a seeded shuffle), after a warm-up that compiles what each one uses.
A graph first compiled inside a timed run (a prompt whose cache is larger than any before): its compile seconds,
the drafter's and the target's, are taken out of that run's times and reported.
"""

from __future__ import annotations

import argparse
import random
import types

import torch

from benchmarks.common import compile_seconds, write_json
from benchmarks.fastest_plain import cpu_name
from draftsmith.checkpoint import command_line, drafter_from_checkpoint, environment
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.heads.decode import HeadDrafter
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.tree_build import parse_tree
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.target import load_target, resolve_dtype


def _drafter(ckpt: str, target, mode: str):
    d = drafter_from_checkpoint(ckpt, target)
    mod = getattr(d, "heads", None) or getattr(d, "module", None)  # Hydra heads, or an EAGLE-3 or DFlash module
    if not callable(getattr(mod, "fast_drafting", None)):
        raise ValueError(f"{ckpt}: its drafter has no compiled drafting (Hydra heads, EAGLE-3 and DFlash have)")
    if isinstance(d, HeadDrafter):
        apply_cpu_layout(target, d)
    if mode == "compiled, own weights":
        mod.fast_drafting = types.MethodType(lambda self: type(self).fast_drafting(self, int8=False), mod)
    elif mode == "eager drafting":
        mod.fast_drafting = None  # the decoder then drafts with the drafter itself
    d.name = mode
    return d


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tree", default="built:best")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    choice = resolve_dtype(a.dtype, "cpu")
    target = load_target("smollm2-135m-instruct", dtype=choice.dtype)
    use_fast_forward(target, "compile")
    tree = parse_tree(a.tree, a.checkpoint)
    greedy = SamplingParams(0.0, 0, 1.0)
    decs = {m: SpeculativeDecoder(target, _drafter(a.checkpoint, target, m), tree=tree, sampling=greedy)
            for m in ("eager drafting", "compiled, own weights", "compiled, int8 weights")}
    decs["plain"] = SpeculativeDecoder(target, sampling=greedy)
    prompts = mtbench_prompts(target.tokenizer, a.prompts + 1, spread=True)
    for dec in decs.values():  # warm-up: every graph each method uses
        for _ in range(2):
            dec.generate(prompts[0].ids, 16)
    acc = {m: {"tokens": 0, "wall_s": 0.0, "steps": 0, "draft_s": 0.0, "verify_s": 0.0} for m in decs}
    # graphs first compiled inside the timed runs (a prompt needing a larger cache than the warm-up's): their
    # compile seconds, the drafter's and the target's, are taken out of that run's times and reported
    for k, p in enumerate(prompts[1:]):
        order = list(decs)
        random.Random(a.seed * 7919 + k).shuffle(order)
        for m in order:
            drafters = [decs[m].drafter] if decs[m].drafter is not None else []
            c0, d0 = compile_seconds(target, drafters), compile_seconds(None, drafters)
            r = decs[m].generate(p.ids, a.max_new_tokens)
            s = acc[m]
            late, late_draft = compile_seconds(target, drafters) - c0, compile_seconds(None, drafters) - d0
            s["compile_in_timed_s"] = s.get("compile_in_timed_s", 0.0) + late
            s["wall_s"] -= late
            s["draft_s"] -= late_draft
            s["tokens"] += len(r.tokens)
            s["wall_s"] += r.wall_s
            s["steps"] += len(r.steps)
            s["draft_s"] += sum(x.draft_s for x in r.steps)
            s["verify_s"] += sum(x.verify_s for x in r.steps)
    plain = acc["plain"]["tokens"] / acc["plain"]["wall_s"]
    report = {"cpu": cpu_name(), "threads": a.threads, "dtype": choice.name, "checkpoint": a.checkpoint,
              "tree": a.tree, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "methods": {},
              "compile_s": {m: round(getattr(d.drafter, "compile_s", 0.0), 1) for m, d in decs.items()
                            if d.drafter is not None},
              "command": command_line(), "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads; {choice.name}; tree {a.tree}; {a.prompts} prompts x "
          f"{a.max_new_tokens}")
    print("| drafting | draft ms/step | verify ms/step | tau | tok/s | vs plain | compiling taken out (s) |\n"
          "|---|---|---|---|---|---|---|")
    for m, s in acc.items():
        tps = s["tokens"] / s["wall_s"]
        row = {"draft_ms": 1e3 * s["draft_s"] / s["steps"], "verify_ms": 1e3 * s["verify_s"] / s["steps"],
               "tau": s["tokens"] / s["steps"], "tok_s": tps, "x_plain": tps / plain,
               "compile_in_timed_s": s["compile_in_timed_s"]}
        report["methods"][m] = {k: round(v, 3) for k, v in row.items()}
        print(f"| {m} | {row['draft_ms']:.2f} | {row['verify_ms']:.2f} | {row['tau']:.3f} | {tps:.2f} | "
              f"{row['x_plain']:.3f}x | {s['compile_in_timed_s']:.1f} |")
    if a.out:
        write_json(a.out, report, indent=1)
    return report


if __name__ == "__main__":
    main()
