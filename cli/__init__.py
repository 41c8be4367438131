"""The ``draftsmith`` command line: one subcommand per stage.

  draftsmith data RECIPE [key=value ...]     prompts -> target-regenerated responses
  draftsmith cache RECIPE [...]              one target pass; stores what the drafter needs
  draftsmith train RECIPE [...]              train the drafter (also under `accelerate launch`)
  draftsmith report RECIPE [...]             held-out head accuracy of the final checkpoint
  draftsmith run RECIPE [...]                all of the above, in order
  draftsmith quickstart [...]                `run quickstart` on the default target
  draftsmith info PATH                       describe a checkpoint, cache or recipe
  draftsmith eval CHECKPOINT [...]           decode MT-Bench with the lossless decoder
  draftsmith export CKPT --to FMT --out DIR  vllm-medusa | hf | draftsmith, checked by reload
  draftsmith import SRC --out CKPT           a vLLM-Medusa or original-Medusa dir -> checkpoint
  draftsmith traces RECIPE [--checkpoint C]  acceptance traces of a chain drafter on training prompts
  draftsmith predictors TRACES               DISCO and SpecDec++ trained and tuned on those traces
  draftsmith serve [--publish DIR --logs DIR] OpenAI-compatible server, lossless decoding, logs traffic
  draftsmith online RECIPE --logs DIR        continual distillation from the logs (rollback|status|import)

Under accelerate: ``accelerate launch --config_file recipes/launch/cpu_ddp2.yaml -m draftsmith.cli train RECIPE``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from draftsmith import registry

STAGES = ("data", "cache", "train", "trees", "report", "bench")


def _recipe(args):
    from draftsmith.recipe import load_recipe
    return load_recipe(args.recipe, args.overrides)


def _target(recipe):
    import torch
    from draftsmith.target import load_target
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    t0 = time.time()
    target = load_target(recipe.target, device="cuda" if torch.cuda.is_available() else "cpu")
    print(f"target {target.name} ({target.fingerprint}) loaded in {time.time() - t0:.1f} s")
    return target


def _run_stages(args, stages) -> int:
    import os
    from draftsmith.cli import pipeline
    if int(os.environ.get("RANK", "0")) != 0:  # under a launcher only rank 0 talks
        sys.stdout = open(os.devnull, "w")
    recipe = _recipe(args)
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
    target = _target(recipe)
    times = {}
    ckpt = recipe.out / "final"
    for st in stages:
        t0 = time.time()
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
            tr = pipeline.stage_trees(recipe, target, ckpt)
            if "skipped" in tr:
                print(f"trees: {tr['skipped']}")
            else:
                kind = "held-out" if tr["source"].get("held_out", True) else "(NOT held-out: trained on)"
                print(f"trees from {tr['source']['sequences']} {kind} training sequences: " + ", ".join(
                    f"{b} nodes -> expected tau {t['expected_tau']:.2f}" for b, t in tr["trees"].items()) +
                    f" (chain K={len(tr['rank_acc'])}: {tr['chain_expected_tau'][str(len(tr['rank_acc']))]:.2f})")
            if "best" in tr:
                print("measured step cost on this machine (verification vs a 1-row forward): " + ", ".join(
                    f"{b} nodes x{t['step_cost']:.2f} -> {t['relative_speed']:.2f}x plain" for b, t in
                    tr["trees"].items()) + f"; best: built:{tr['best']} (--tree built:best)")
        elif st == "report":
            rep = pipeline.stage_report(recipe, target, ckpt)
            print((recipe.out / "report.md").read_text())
        elif st == "bench":
            b = pipeline.stage_bench(recipe, target, ckpt)
            print(f"decoding {b['prompts']} MT-Bench first turns, {b['max_new_tokens']} new tokens, greedy "
                  f"(interleaved, this machine):")
            print(b["table"])
        times[st] = round(time.time() - t0, 1)
    print(f"stage seconds: {times}; total {time.time() - t_all:.1f} s; outputs in {recipe.out}")
    return 0


def _info(args) -> int:
    p = Path(args.path)
    from draftsmith.checkpoint import read_json, read_manifest
    for name in ("manifest.json", "index.json", "meta.json"):
        if (p / name).exists():  # a malformed file is an error naming it (CheckpointError, exit 2)
            obj = read_manifest(p) if name == "manifest.json" else read_json(p / name, name)
            print(json.dumps(obj, indent=2)[:20000])
            return 0
    if p.suffix in (".yaml", ".yml") or not p.exists():
        from draftsmith.recipe import load_recipe
        print(json.dumps(load_recipe(p).model_dump(mode="json"), indent=2))
        return 0
    print(f"{p}: not a draftsmith checkpoint, cache, data directory or recipe", file=sys.stderr)
    return 2


def _export_import(args) -> int:
    from draftsmith import export
    from draftsmith.target import load_target
    if args.cmd == "import":
        target = load_target(export.import_target(args.source, args.target))
        out = export.import_drafter(args.source, args.out, target)
        print(f"imported {args.source} -> checkpoint {out} for target {target.name} ({target.fingerprint})")
        return 0
    target = load_target(export.source_target(args.source, args.target))
    out = export.export(args.source, args.to, args.out, target, base_model=args.base_model)
    print(f"exported {args.source} as {args.to} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))}); "
          f"loaded back and checked")
    return 0


def _predictors(args) -> int:
    """`draftsmith traces` and `draftsmith predictors` (acceptance predictors, classifiers/)."""
    from draftsmith.cli import pipeline
    from draftsmith.train.predictors import format_summary, train_predictors
    from draftsmith.checkpoint import read_json
    from draftsmith.target import load_target
    if args.cmd == "traces":
        recipe = _recipe(args)
        res = pipeline.stage_traces(recipe, _target(recipe), checkpoint=args.checkpoint, prompts=args.prompts,
                                    max_new_tokens=args.max_new_tokens, draft_len=args.draft_len,
                                    temperatures=args.temperature, out=args.out,
                                    calibration_every=args.calibration_every)
        print(f"traces of {res['drafter']['name']} on {res['prompts']} training prompts: {res['summary']} "
              f"-> {res['out']}")
        return 0
    meta = read_json(Path(args.traces) / "meta.json", "acceptance-trace meta", required=("target.name",))
    target = load_target(meta["target"]["name"])
    res = train_predictors(args.traces, target, kinds=args.kinds, out=args.out, max_len=args.max_len,
                           epochs=args.epochs)
    print(format_summary(res))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in (*STAGES, "run"):
        sp = sub.add_parser(name, help=f"{name} stage" if name != "run" else "every stage in order")
        sp.add_argument("recipe", help="recipe YAML path or built-in name (quickstart, medusa-large)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=5e-4")
        if name in ("train", "run"):
            sp.add_argument("--fresh", action="store_true", help="ignore existing checkpoints (no resume)")
    qs = sub.add_parser("quickstart", help="the main job: run the quickstart recipe on the default target")
    qs.add_argument("overrides", nargs="*")
    info = sub.add_parser("info", help="describe a checkpoint, cache, data dir or recipe")
    info.add_argument("path")
    ev = sub.add_parser("eval", help="evaluate with the lossless decoder (see `draftsmith eval -h`)", add_help=False)
    ev.add_argument("rest", nargs=argparse.REMAINDER)
    ex = sub.add_parser("export", help="export a drafter to a layout serving engines load (checked by reload)")
    ex.add_argument("source", help="checkpoint directory, or first-layers:N (the untrained baseline, --to hf)")
    ex.add_argument("--to", required=True, choices=("vllm-medusa", "hf", "draftsmith"), help="export format")
    ex.add_argument("--out", required=True, help="new output directory")
    ex.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's)")
    ex.add_argument("--base-model", default=None,
                    help="what engines load as the target (default: the target's directory)")
    tr = sub.add_parser("traces", help="record acceptance traces of a chain drafter on the recipe's training prompts")
    tr.add_argument("recipe", help="recipe YAML path or built-in name")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. threads=1")
    tr.add_argument("--checkpoint", default=None,
                    help="drafter checkpoint (default: the recipe's final), or first-layers:N / early-exit:L")
    tr.add_argument("--prompts", type=int, default=100, help="training prompts to decode (first user turns)")
    tr.add_argument("--max-new-tokens", type=int, default=128)
    tr.add_argument("--draft-len", type=int, default=8, help="fixed chain length while recording")
    tr.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    tr.add_argument("--calibration-every", type=int, default=5, help="every N-th prompt goes to the calibration split")
    tr.add_argument("--out", default=None, help="output directory (default: RUN/traces)")
    pr = sub.add_parser("predictors", help="train DISCO and SpecDec++ on acceptance traces (per temperature)")
    pr.add_argument("traces", help="a directory written by `draftsmith traces`")
    pr.add_argument("--kinds", nargs="+", choices=sorted(registry.predictors()), default=None,
                    help="length predictors to train (default: all)")
    pr.add_argument("--out", default=None, help="output directory (default: next to the traces, predictors/)")
    pr.add_argument("--max-len", type=int, default=8, help="the longest round the policies may draft")
    pr.add_argument("--epochs", type=int, default=20, help="SpecDec++ head epochs")
    mg = sub.add_parser("merge", help="data + caches of several finished data runs as one directory (for shared_data)")
    mg.add_argument("out", help="new directory (then train with shared_data=OUT)")
    mg.add_argument("runs", nargs="+", help="run directories whose data and cache stages finished")
    im = sub.add_parser("import", help="a vLLM-Medusa or original-Medusa / TGI directory -> draftsmith checkpoint")
    im.add_argument("source", help="directory with config.json and model.safetensors or medusa_lm_head.safetensors")
    im.add_argument("--out", required=True, help="new checkpoint directory")
    im.add_argument("--target", default=None,
                    help="target name or directory (default: its base_model_name_or_path if local, else the default)")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "accelerate", "DeepSpeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    from draftsmith.recipe import RecipeError
    from draftsmith.target import TargetMismatchError
    try:
        if argv[:1] == ["serve"]:  # the server and the online job own their options, like eval
            from draftsmith.cli import serve
            return serve.main(argv[1:])
        if argv[:1] == ["online"]:
            from draftsmith.cli import online
            return online.main(argv[1:])
        if argv[:1] == ["eval"]:  # the decoder CLI owns its own options (argparse REMAINDER drops leading flags)
            from draftsmith.eval.cli import eval_main
            eval_main(argv[1:])  # returns the report (already written); the exit status is 0
            return 0
        args = build_parser().parse_args(argv)
        if args.cmd == "info":
            return _info(args)
        if args.cmd in ("export", "import"):
            return _export_import(args)
        if args.cmd in ("traces", "predictors"):
            return _predictors(args)
        if args.cmd == "merge":
            from draftsmith.cli.pipeline import merge_runs
            m = merge_runs(Path(args.out), [Path(r) for r in args.runs])
            print(f"merged {len(args.runs)} runs -> {args.out}: {m['cache_sequences']} sequences, "
                  f"{m['cache_tokens']} tokens ({m['sources']}); train with shared_data={args.out}")
            return 0
        if args.cmd == "quickstart":
            args.recipe = "quickstart"
            return _run_stages(args, STAGES)
        return _run_stages(args, STAGES if args.cmd == "run" else (args.cmd,))
    except (RecipeError, TargetMismatchError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
