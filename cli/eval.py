"""``draftsmith eval``: benchmark a drafter checkpoint against plain decoding and Hugging Face.

    draftsmith eval CHECKPOINT [--plain] [--drafter-layers N] [--hf-assisted] [--prompts N]
                    [--max-new-tokens 128] [--temperature 0 ...] [--tree SPEC ...] [--suffix] --out DIR

``--suffix`` adds model-free drafting: ours SuffixDecoding alone (its global
index learns from every finished response, in prompt order), ours and
Hugging Face's prompt lookup, and each checkpoint's drafter beside
SuffixDecoding (the hybrid); ``draftsmith eval none --suffix`` runs it
without a checkpoint.

CHECKPOINT is a drafter checkpoint directory, or ``none`` to benchmark
baselines only. Plain decoding with our decoder always runs: it is the
baseline every speedup names. On a CPU, when the methods decode in another
dtype, our plain decoding in float32 runs too (``--plain-float32``; the
packed 4/8-bit weights of a quantised target file make it the fastest plain
decoding there), and every speedup also names the fastest plain decoding
measured. Writes DIR/report.json (every figure, the command, the config and
the environment), DIR/report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith import registry
from draftsmith.checkpoint import command_line, environment, read_manifest, resolve_drafter
from draftsmith.cli.shared import add_dtype_arg, add_suffix_args, load_target_as, suffix_config
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.fastpath import add_forward_arg, decode_dtype, use_fast_forward
from draftsmith.engine.drafters import SelfDrafter
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.tree_build import TREES, parse_tree
from draftsmith.export.llamacpp_server import llamacpp_plain_methods
from draftsmith.eval.bench import (compile_seconds, default_methods, mark_fastest_plain, plain_in_dtype,
                                   prepare_plain_target, run_bench, table)
from draftsmith.eval.compare import self_drafter_methods, tree_specs_for
from draftsmith.eval.mtbench import mtbench_prompts, user_prompts
from draftsmith.eval.report import write_report
from draftsmith.eval.suffix import suffix_methods, suffix_stats
from draftsmith.target import default_device, dtype_name, resolve_dtype
from draftsmith.train.data.suffix_seed import save_index_from_data


def add_parser(subparsers, name: str, summary: str) -> None:
    """Listed by ``draftsmith --help``; ``draftsmith.cli.main`` calls `main` with the arguments as given,
    because argparse's REMAINDER drops leading options (``draftsmith eval --plain CKPT``)."""
    sp = subparsers.add_parser(name, help=summary, add_help=False)
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return main(args.rest)


def main(argv: list[str]) -> int:
    eval_main(argv)  # returns the report (already written); the exit status is 0
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="+",
                    help="drafter checkpoint directories or decoder-only drafters (first-layers:N, early-exit:L, "
                         "suffix, prompt-lookup:K), several benchmarked side by side, interleaved; or 'none' for "
                         "baselines only")
    ap.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's target)")
    ap.add_argument("--plain", action="store_true", help="also run Hugging Face generate (plain decoding)")
    ap.add_argument("--drafter-layers", type=int, default=None,
                    help="also run a standalone drafter made of the target's first N layers (untrained baseline)")
    ap.add_argument("--draft-len", type=int, default=4, help="draft length K for chains (ours and HF assisted)")
    ap.add_argument("--hf-assisted", action="store_true",
                    help="also run HF assisted generation with the --drafter-layers model as assistant")
    ap.add_argument("--prompts", type=int, default=80,
                    help="number of MT-Bench first turns (fewer than 80: evenly spread over the categories)")
    ap.add_argument("--prompts-file", default=None, metavar="JSONL",
                    help="your own prompts instead of MT-Bench: one JSON object a line, {\"prompt\": ...}, "
                         "{\"messages\": [...]} or {\"turns\": [...]}, optional \"category\" "
                         "(--prompts caps the count)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="0 = greedy; several allowed")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--tree", action="append", default=None,
                    help="tree for the checkpoint's drafter: chain | built:B | dynamic[:B,D,W] | JSON paths | JSON "
                         "file; repeatable (default: chain); NAME=SPEC applies to the checkpoint of that recipe name "
                         "only (several checkpoints side by side)")
    ap.add_argument("--confidence", type=float, default=None,
                    help="Kangaroo checkpoints: threshold of the second early exit (default: the checkpoint's)")
    ap.add_argument("--fixed-len", type=int, nargs="+", default=[],
                    help="Kangaroo checkpoints: also draft at these fixed lengths (the same adapter, no early exit)")
    ap.add_argument("--full-verify", action="store_true",
                    help="Kangaroo checkpoints: also verify the same drafts through all L layers (vs l+1..L)")
    ap.add_argument("--early-exit", type=int, default=None, metavar="L",
                    help="also run the untrained early-exit self-drafter (first L layers + LM head, --draft-len)")
    ap.add_argument("--hf-early-exit", type=int, default=None, metavar="L",
                    help="also run Hugging Face assisted generation with assistant_early_exit=L (--draft-len)")
    add_suffix_args(ap, "also run SuffixDecoding alone, prompt lookup (ours and HF) and each checkpoint beside "
                        "SuffixDecoding (hybrid)")
    ap.add_argument("--suffix-index", default=None, metavar="DIR",
                    help="SuffixDecoding: start from a saved global index (SuffixIndex.save)")
    ap.add_argument("--suffix-from-data", default=None, metavar="JSONL",
                    help="SuffixDecoding: start from an index of the answers in a conversations file (a data "
                         "stage's data/train.jsonl), saved as OUT/suffix_index")
    ap.add_argument("--no-hf-prompt-lookup", dest="hf_prompt_lookup", action="store_false",
                    help="with --suffix: leave Hugging Face's prompt lookup out")
    ap.add_argument("--no-prompt-lookup", dest="ours_prompt_lookup", action="store_false",
                    help="with --suffix: leave our prompt lookup out (SuffixDecoding alone and the hybrids stay)")
    ap.add_argument("--prompt-lookup", type=int, default=10, metavar="K",
                    help="prompt lookup's draft length (ours and HF's prompt_lookup_num_tokens) with --suffix")
    ap.add_argument("--llamacpp", default="", metavar="TYPES",
                    help="also llama.cpp's plain decoding on the target's GGUF of these types, comma-separated "
                         "(shipped = the file the default or a named target ships as; q4_1, bf16, f32 converted), "
                         "through llama-server, interleaved per prompt with our methods, greedy only; needs "
                         "`bash scripts/llamacpp_env.sh`")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    add_dtype_arg(ap, None, "the first checkpoint's recipe dtype, else float32")
    ap.add_argument("--plain-float32", default="auto", choices=["auto", "on", "off"],
                    help="also time our plain decoding in float32 (the target's 4/8-bit blocks packed where it "
                         "ships as a quantised file) when the methods decode in another dtype; auto (default): on a "
                         "CPU. The fastest plain decoding on a CPU may be one the drafters do not run in")
    ap.add_argument("--no-cpu-layout", dest="cpu_layout", action="store_false",
                    help="keep PyTorch's default weight layout on CPU (default: column-major linears, oneDNN-packed "
                         "copies for 2+ rows and a transposed LM-head copy for every method, see "
                         "draftsmith.engine.cpu_layout)")
    add_forward_arg(ap)
    ap.add_argument("--out", required=True, help="output directory")
    return ap


def eval_main(argv: list[str] | None = None) -> dict:
    """Entry point of ``draftsmith eval``; returns the report dict."""

    a = build_parser().parse_args(argv)
    loaded = load_for_eval(a)
    return evaluate(a, loaded, eval_prompts(a, loaded.target), a.out)


@dataclass
class Loaded:
    """What `load_for_eval` sets up once for any number of prompt sets (`evaluate` per set)."""

    target: object
    drafters: list  # (drafter, [(tree label, tree), ...]) per checkpoint
    dtype: str | None
    layout: dict | None
    forward: dict
    plain_targets: tuple = ()  # the target in other dtypes, each timed as plain decoding only
    dtype_reason: str | None = None  # why decoding runs in this dtype, where `decode_dtype` chose it


def load_for_eval(a: argparse.Namespace) -> Loaded:
    """The target and every checkpoint's drafter with its trees, in the CPU decoding layout and with the target's
    forward chosen, from ``draftsmith eval``'s parsed arguments."""
    if a.hf_assisted and not a.drafter_layers:
        raise SystemExit("--hf-assisted needs --drafter-layers N (the assistant model)")
    ckpts = [] if [c.lower() for c in a.checkpoint] == ["none"] else list(a.checkpoint)
    target_name, dtype = a.target, a.dtype
    dirs = [Path(c) for c in ckpts if Path(c).is_dir() or registry.untrained_drafter_name(c) is None]
    if dirs:  # the first checkpoint's target and dtype, unless given
        manifest = read_manifest(dirs[0])
        t = manifest["target"]
        if target_name is None:
            target_name = t["path"] if Path(t["path"]).exists() else t["name"]
        dtype = dtype or (manifest.get("recipe") or {}).get("dtype")
    target_name = target_name or "smollm2-135m-instruct"
    reason = None
    if dtype == "auto":  # decoding's auto: float32 for a target that ships as a low-bit GGUF file (packed weights)
        choice = decode_dtype(dtype, target_name, default_device(a.device), a.forward)
        if choice.dtype == torch.float32:
            print(f"target dtype float32 ({choice.reason})")
            dtype, reason = "float32", choice.reason
    target = load_target_as(target_name, dtype, default_device(a.device))
    drafters = []
    for c in ckpts:
        d = resolve_drafter(c, target)
        if Path(c).is_dir():
            d.name = (read_manifest(c).get("recipe") or {}).get("name") or d.name
            if d.name in {x.name for x, _ in drafters}:  # two runs of one recipe: their run directories tell them apart
                d.name = f"{d.name} ({run_name(c)})"
        if a.confidence is not None and isinstance(d, SelfDrafter):  # another second-early-exit threshold
            d.set_confidence(a.confidence)
        specs = tree_specs_for(a.tree or ["chain"], d.name)
        if not capabilities(d).supports_trees:  # chain-only drafters: the other specs are for other checkpoints
            if "chain" not in specs and len(a.checkpoint) == 1:
                raise ValueError(f"{c} holds a {d.name!r} drafter, which drafts chains only: add --tree chain")
            if specs != ["chain"]:
                print(f"{d.name}: chains only, drafted as a chain (trees {[t for t in specs if t != 'chain']} "
                      "are for the other checkpoints)")
            specs = ["chain"]
        if not (Path(c) / TREES).exists():  # built:N needs trees built for this checkpoint (the trees stage)
            built = [t for t in specs if t.strip().startswith("built:")]
            if built and len(built) == len(specs) and len(a.checkpoint) == 1:
                raise ValueError(f"{c} has no built trees ({TREES}) for {built}: run `draftsmith trees` on it "
                                 "or give another --tree")
            if built:
                print(f"{d.name}: no built trees, so {built} are for the other checkpoints")
                specs = [t for t in specs if t not in built] or ["chain"]
        drafters.append((d, [(t, parse_tree(t, c)) for t in specs]))
    layout = None
    if a.cpu_layout:
        layout = apply_cpu_layout(target, *[d for d, _ in drafters])
        if layout["applied"]:
            print(f"CPU decoding layout: {layout['linears']} linears column-major, "
                  f"{layout.get('packed', 0)} oneDNN-packed, {layout['heads']} head copies")
    forward = use_fast_forward(target, a.forward)
    print(f"target forward: {forward}")
    others = []
    want = getattr(a, "plain_float32", "off")
    if want == "on" or (want == "auto" and target.model.device.type == "cpu"):
        if target.dtype != torch.float32:
            other = load_target_as(target_name, "float32", target.model.device)
            prepare_plain_target(other, a.forward, a.cpu_layout)
            others.append(other)
    return Loaded(target, drafters, dtype, layout, forward, tuple(others), reason)


def run_name(checkpoint: str | Path) -> str:
    """A checkpoint's run: its directory's name, or its run directory's for a run's ``final`` or ``checkpoints/N``."""
    p = Path(checkpoint).resolve()
    if p.name == "final":
        return p.parent.name
    if p.parent.name == "checkpoints":
        return p.parent.parent.name
    return p.name


def eval_prompts(a: argparse.Namespace, target) -> list:
    """The prompts ``draftsmith eval`` decodes: the user's file (malformed lines counted) or MT-Bench first turns."""
    if a.prompts_file:
        prompts, bad = user_prompts(target.tokenizer, a.prompts_file, a.prompts)
        if bad["skipped"]:
            print(f"prompts file: skipped {sum(bad['skipped'].values())} lines {bad['skipped']} "
                  f"(first at {bad['first_skipped_at']})")
        return prompts
    return mtbench_prompts(target.tokenizer, a.prompts, spread=True)


def evaluate(a: argparse.Namespace, loaded: Loaded, prompts: list, out: str | Path,
             more_plain: Callable[[dict, list, SamplingParams, str], None] | None = None,
             described: str | None = None) -> dict:
    """Benchmark every method on ``prompts`` at each of ``a.temperature``; write the report into ``out`` and
    return it. Prompts too long for the context are left out and counted (an error when none is left).
    ``more_plain(figures, prompts, sampling, label)``: adds other engines' plain decoding to each run's figures
    before the report is written (`draftsmith.eval.bench.add_plain`). ``described``: what the prompts are, for the
    report (default: the user's file or MT-Bench first turns)."""
    target, drafters, dtype = loaded.target, loaded.drafters, loaded.dtype
    room = target.context_length - a.max_new_tokens - 64  # 64: the largest draft block a method verifies
    too_long = [p for p in prompts if len(p.ids) > room]
    if too_long:
        print(f"skipped {len(too_long)} prompts longer than {room} tokens (context {target.context_length} - "
              f"{a.max_new_tokens} new tokens - a draft block of 64), first: #{too_long[0].question_id}")
        prompts = [p for p in prompts if len(p.ids) <= room]
        if not prompts:
            raise ValueError("every prompt is too long for the target's context")
    index_dir, seeded = a.suffix_index, None
    if a.suffix_from_data:
        if a.suffix_index or not a.suffix:
            raise ValueError("--suffix-from-data goes with --suffix, and not with --suffix-index")
        index_dir = Path(out) / "suffix_index"
        seeded = save_index_from_data(a.suffix_from_data, target.tokenizer, index_dir, target.fingerprint,
                                      suffix_config(a, both_ok=True))
        print(f"suffix index from {a.suffix_from_data}: {seeded['replies']} answers, {seeded['indexed_tokens']} "
              f"tokens; skipped {seeded['skipped'] or 'none'}")
    runs = {}
    for temp in a.temperature:
        sampling = SamplingParams(temp, a.top_k if temp > 0 else 0, a.top_p if temp > 0 else 1.0)
        label = "greedy" if sampling.greedy else f"T={temp}"
        methods = default_methods(target, sampling, drafter_layers=a.drafter_layers, draft_len=a.draft_len,
                                  hf=a.plain, hf_assisted_too=a.hf_assisted, cpu_layout=a.cpu_layout)
        for other in loaded.plain_targets:
            methods.insert(1, plain_in_dtype(other, sampling))
        for d, trees in drafters:
            methods += default_methods(target, sampling, drafter_layers=None, hf=False, heads=d, trees=trees)[1:]
            methods += self_drafter_methods(target, d, sampling, a, trees)
        methods += self_drafter_methods(target, None, sampling, a)
        if a.suffix:
            cfg = suffix_config(a, both_ok=True)
            hybrids = [(d, trees) for d, trees in drafters if capabilities(d).verify_forward is None]
            also = [("cost-aware", cfg.model_copy(update={"cost_aware": True}))] \
                if a.suffix_cost_aware == "both" else []
            extra, members = suffix_methods(target, sampling, hybrids, config=cfg, lookup_k=a.prompt_lookup,
                                            index_dir=index_dir, hf_lookup=a.hf_prompt_lookup,
                                            ours_lookup=a.ours_prompt_lookup, also=also)
            methods += extra
        left_out: dict = {}
        with contextlib.ExitStack() as servers:  # llama.cpp's plain decoding, interleaved with ours
            methods += llamacpp_plain_methods(servers, left_out, target, [t for t in a.llamacpp.split(",") if t],
                                              sampling=sampling)
            print(f"== {label}: {', '.join(m.name for m in methods)}", flush=True)
            runs[label] = run_bench(methods, prompts, a.max_new_tokens, seed=a.seed,
                                    compile_clock=lambda: compile_seconds(target, [d for d, _ in drafters]) + sum(
                                        compile_seconds(t) for t in loaded.plain_targets))
        runs[label].update(left_out)
        if a.suffix:
            runs[label]["suffix"] = suffix_stats(members)
        if runs[label].get("llamacpp"):
            print(f"llama.cpp: left out ({runs[label]['llamacpp'].splitlines()[0]})")
        if more_plain is not None:
            more_plain(runs[label], prompts, sampling, label)
        mark_fastest_plain(runs[label])  # names the fastest plain decoding measured
        print(table(runs[label]), flush=True)
    config = {k: v for k, v in vars(a).items()}
    config["cpu_layout"] = loaded.layout
    config["suffix_index_seeded"] = seeded
    config["forward"] = dict(loaded.forward, compile_s=round(getattr(target.fast_body, "compile_s", 0.0), 1),
                             drafter_compile_s={d.name: round(getattr(d, "compile_s", 0.0), 1) for d, _ in drafters})
    config["target"] = {"name": target.name, "path": str(target.path), "fingerprint": target.fingerprint,
                        "dtype": dtype_name(target.dtype),
                        "dtype_reason": loaded.dtype_reason or resolve_dtype(dtype, target.model.device).reason}
    config["out"], config["prompts_decoded"] = str(out), len(prompts)
    config["prompt_set"] = described or (f"prompts of {a.prompts_file}" if a.prompts_file else "MT-Bench first turns")
    report = write_report(out, runs, config, command_line(), environment())
    print(f"wrote {Path(out) / 'report.json'}, report.md and {len(report['plots'])} plots")
    return report

