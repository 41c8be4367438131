"""``draftsmith eval``: benchmark a drafter checkpoint against plain decoding and Hugging Face.

    draftsmith eval CHECKPOINT [--plain] [--drafter-layers N] [--hf-assisted] [--prompts N]
                    [--max-new-tokens 128] [--temperature 0 ...] [--tree SPEC ...] --out DIR

CHECKPOINT is a drafter checkpoint directory, or ``none`` to benchmark
baselines only. Plain decoding with our decoder always runs: it is the
baseline every speedup names. Writes DIR/report.json (every figure, the
command, the config and the environment), DIR/report.md and PNG plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.drafters.kangaroo.decode import early_exit_drafter
from draftsmith.eval.bench import Method, hf_run, ours
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.drafters import SelfDrafter
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.tree_build import TREES, parse_tree  # noqa: F401  (parse_tree re-exported)


def tree_specs_for(specs: list[str], name: str) -> list[str]:
    """The --tree specs for the checkpoint of recipe ``name``: the plain ones and its own NAME=SPEC ones."""
    out = []
    for t in specs:
        head, sep, rest = t.partition("=")
        if not sep or head.strip().startswith(("[", "{")) or "/" in head:  # a plain spec (JSON, file path)
            out.append(t)
        elif head.strip() == name:
            out.append(rest)
    return out or ["chain"]


def self_drafter_methods(target, drafter, sampling, a, trees=()) -> list:
    """Kangaroo variants of a checkpoint's drafter (fixed lengths, full-depth verification of its chain and of
    each of its ``trees`` [(spec, tree)]), or with ``drafter=None`` the early-exit peers (ours and Hugging
    Face's), as requested by the options."""
    def dec(d, policy=None, tree=None):
        return SpeculativeDecoder(target, d, policy=policy, sampling=sampling, tree=tree)

    if drafter is None:
        out = []
        if a.early_exit:
            out.append(ours(f"ours early-exit-{a.early_exit} K={a.draft_len}",
                            dec(early_exit_drafter(target, a.early_exit), FixedLength(a.draft_len))))
        if a.hf_early_exit:
            out.append(_hf_early_exit(target, a.hf_early_exit, a.draft_len, sampling))
        return out
    if not isinstance(drafter, SelfDrafter):
        return []
    out = [ours(f"ours {drafter.name} K={k}", dec(drafter, FixedLength(k))) for k in a.fixed_len]
    if a.full_verify:
        out.append(ours(f"ours {drafter.name} full-verify", dec(drafter.variant(full_verify=True))))
        out += [ours(f"ours {drafter.name} {spec} full-verify", dec(drafter.variant(full_verify=True), tree=tree))
                for spec, tree in trees if tree is not None]
    return out


def _hf_early_exit(target, exit_layer: int, k: int, sampling) -> Method:
    """HF assisted generation drafting with the target's own first layers (constant k drafts).

    HF drafts by calling the same model with ``config.num_hidden_layers`` lowered, so those calls
    are subtracted from the forward count: tau counts full-depth forwards only, as for ours."""
    model = target.model
    full = int(model.config.num_hidden_layers)
    inner = hf_run(target, sampling, {"assistant_early_exit": exit_layer, "num_assistant_tokens": k,
                                     "num_assistant_tokens_schedule": "constant",
                                     "assistant_confidence_threshold": 0.0})

    def run(ids, n, seed):
        drafts = [0]

        def hook(module, args):
            drafts[0] += int(model.config.num_hidden_layers) != full

        h = model.register_forward_pre_hook(hook)
        try:
            r = inner(ids, n, seed)
        finally:
            h.remove()
        r.counted_forwards -= drafts[0]
        return r

    return Method(f"HF early-exit-{exit_layer} K={k}", run, "hf")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="+",
                    help="drafter checkpoint directories (several are benchmarked side by side, interleaved), "
                         "or 'none' for baselines only")
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
                         "{\"messages\": [...]} or {\"turns\": [...]}, optional \"category\" (--prompts caps the count)")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    ap.add_argument("--no-cpu-layout", dest="cpu_layout", action="store_false",
                    help="keep PyTorch's default weight layout on CPU (default: column-major linears, oneDNN-packed "
                         "copies for 2+ rows and a transposed LM-head copy for every method, see "
                         "draftsmith.engine.cpu_layout)")
    ap.add_argument("--out", required=True, help="output directory")
    return ap


def eval_main(argv: list[str] | None = None) -> dict:
    """Entry point of ``draftsmith eval``; returns the report dict."""
    from draftsmith.checkpoint import command_line, environment, read_manifest
    from draftsmith.eval.bench import default_methods, run_bench, table
    from draftsmith.checkpoint import drafter_from_checkpoint
    from draftsmith.eval.mtbench import mtbench_prompts, user_prompts
    from draftsmith.eval.report import write_report
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.target import default_device, load_target

    a = build_parser().parse_args(argv)
    if a.hf_assisted and not a.drafter_layers:
        raise SystemExit("--hf-assisted needs --drafter-layers N (the assistant model)")
    ckpts = [] if [c.lower() for c in a.checkpoint] == ["none"] else [Path(c) for c in a.checkpoint]
    target_name = a.target
    if target_name is None and ckpts:
        t = read_manifest(ckpts[0])["target"]
        target_name = t["path"] if Path(t["path"]).exists() else t["name"]
    target = load_target(target_name or "smollm2-135m-instruct", device=default_device(a.device))
    drafters = []
    for c in ckpts:
        d = drafter_from_checkpoint(c, target)
        d.name = (read_manifest(c).get("recipe") or {}).get("name") or d.name
        if a.confidence is not None and isinstance(d, SelfDrafter):  # another second-early-exit threshold
            d.set_confidence(a.confidence)
        specs = tree_specs_for(a.tree or ["chain"], d.name)
        if not getattr(d, "supports_trees", True):  # chain-only drafters: the other specs are for other checkpoints
            if "chain" not in specs and len(a.checkpoint) == 1:
                raise ValueError(f"{c} holds a {d.name!r} drafter, which drafts chains only: add --tree chain")
            if specs != ["chain"]:
                print(f"{d.name}: chains only, drafted as a chain (trees {[t for t in specs if t != 'chain']} are for the other checkpoints)")
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
        from draftsmith.engine.cpu_layout import apply_cpu_layout
        layout = apply_cpu_layout(target, *[d for d, _ in drafters])
        if layout["applied"]:
            print(f"CPU decoding layout: {layout['linears']} linears column-major, "
                  f"{layout.get('packed', 0)} oneDNN-packed, {layout['heads']} head copies")
    if a.prompts_file:
        prompts, bad = user_prompts(target.tokenizer, a.prompts_file, a.prompts)
        if bad["skipped"]:
            print(f"prompts file: skipped {sum(bad['skipped'].values())} lines {bad['skipped']} "
                  f"(first at {bad['first_skipped_at']})")
    else:
        prompts = mtbench_prompts(target.tokenizer, a.prompts, spread=True)
    room = target.context_length - a.max_new_tokens - 64  # 64: the largest draft block a method verifies
    too_long = [p for p in prompts if len(p.ids) > room]
    if too_long:
        print(f"skipped {len(too_long)} prompts longer than {room} tokens (context {target.context_length} - "
              f"{a.max_new_tokens} new tokens - a draft block of 64), first: #{too_long[0].question_id}")
        prompts = [p for p in prompts if len(p.ids) <= room]
        if not prompts:
            raise ValueError("every prompt is too long for the target's context")
    runs = {}
    for temp in a.temperature:
        sampling = SamplingParams(temp, a.top_k if temp > 0 else 0, a.top_p if temp > 0 else 1.0)
        label = "greedy" if sampling.greedy else f"T={temp}"
        methods = default_methods(target, sampling, drafter_layers=a.drafter_layers, draft_len=a.draft_len,
                                  hf=a.plain, hf_assisted_too=a.hf_assisted, cpu_layout=a.cpu_layout)
        for d, trees in drafters:
            methods += default_methods(target, sampling, drafter_layers=None, hf=False, heads=d, trees=trees)[1:]
            methods += self_drafter_methods(target, d, sampling, a, trees)
        methods += self_drafter_methods(target, None, sampling, a)
        print(f"== {label}: {', '.join(m.name for m in methods)}", flush=True)
        runs[label] = run_bench(methods, prompts, a.max_new_tokens, seed=a.seed)
        print(table(runs[label]), flush=True)
    config = {k: v for k, v in vars(a).items()}
    config["cpu_layout"] = layout
    config["target"] = {"name": target.name, "path": str(target.path), "fingerprint": target.fingerprint}
    report = write_report(a.out, runs, config, command_line(), environment())
    print(f"wrote {Path(a.out) / 'report.json'}, report.md and {len(report['plots'])} plots")
    return report


if __name__ == "__main__":
    eval_main()
