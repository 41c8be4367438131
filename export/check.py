"""Real-target check of every export of a checkpoint: reload, decode, compare.

    python -m draftsmith.export.check CKPT [--prompts 16] [--max-new-tokens 128] [--tree chain|built:N]
                                      [--hf-baseline [--drafter-layers 4]] [--out runs/export-check]

For each format that can hold the checkpoint's kind (Medusa: ``vllm-medusa``
and ``draftsmith``), the checkpoint is exported, loaded back (and the
vllm-medusa directory also imported into a new checkpoint), and each is
decoded greedily on MT-Bench first turns with our decoder: tokens AND the
accepted length of every step must equal the checkpoint's (equal tokens alone
prove nothing: a lossless decoder gives the target's output with any drafter).
A kind with an ``hf`` export (a trained standalone drafter) is then loaded by
transformers: ``generate(assistant_model=export)`` must give the target's own
greedy output. With ``--hf-baseline``, a kind with no hf export checks the
untrained ``first-layers:N`` that way instead (and our decoder from its export
against the in-memory baseline). Writes OUT/export_check.json; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from draftsmith.checkpoint import command_line, config_value, environment
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.engine.trees import StaticTree
from draftsmith.engine.tree_build import load_tree
from draftsmith.export import FORMATS, export, formats_for, import_drafter, load_drafter, load_source, source_target
from draftsmith.target import Target, load_target


def _decode(target: Target, drafter, ids: list[int], n: int, tree) -> tuple[list[int], list[int], float]:
    """(tokens, accepted drafts per step, tau), greedy."""
    r = SpeculativeDecoder(target, drafter, tree=tree).generate(ids, n)
    return r.tokens, [s.accepted for s in r.steps], r.tau


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(ckpt: str | Path, out: str | Path, prompts: int = 16, max_new_tokens: int = 128, drafter_layers: int = 4,
          tree: str = "chain", target: str | None = None, hf_baseline: bool = False) -> dict:
    """Export ``ckpt`` to every format that holds it (and ``first-layers:N`` to hf), reload, decode, compare."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tgt = load_target(source_target(str(ckpt), target))
    static = None if tree == "chain" else StaticTree(load_tree(ckpt, tree.split(":", 1)[1]))
    rows = mtbench_prompts(tgt.tokenizer, prompts, spread=True)
    src = load_source(ckpt, tgt)
    fmts = formats_for(src)
    # a pruned standalone drafter exports its full-size head to hf: that export drafts over the whole vocabulary,
    # so its steps may differ from the checkpoint's (its tokens may not: decoding is lossless)
    pruned = "hf" in fmts and bool(config_value(src.module, "vocab_keep"))
    drafters = {"checkpoint": drafter_from_checkpoint(ckpt, tgt)}
    for fmt in fmts:
        t0 = time.time()
        export(ckpt, fmt, out / fmt, tgt)
        print(f"exported {fmt} in {time.time() - t0:.1f} s: {sorted(p.name for p in (out / fmt).iterdir())}")
        drafters[fmt] = load_drafter(out / fmt, tgt)
        if FORMATS[fmt].read is not None:  # an engine layout draftsmith also imports: the round trip too
            import_drafter(out / fmt, out / f"{fmt}-imported", tgt)
            drafters[f"{fmt} imported"] = drafter_from_checkpoint(out / f"{fmt}-imported", tgt)
    report: dict = {"checkpoint": str(ckpt), "target": {"name": tgt.name, "fingerprint": tgt.fingerprint},
                    "prompts": len(rows), "max_new_tokens": max_new_tokens, "tree": tree, "formats": fmts,
                    "pruned": pruned, "heads": {}, "hf": {}, "command": command_line(), "environment": environment()}
    for name, d in drafters.items():
        report["heads"][name] = {"identical_tokens": 0, "identical_steps": 0, "tau": [], "first_diff": {},
                                 "steps_differ": []}
    for p in rows:
        ref = _decode(tgt, drafters["checkpoint"], p.ids, max_new_tokens, static)
        for name, d in drafters.items():
            res = ref if name == "checkpoint" else _decode(tgt, d, p.ids, max_new_tokens, static)
            r = report["heads"][name]
            r["identical_tokens"] += res[0] == ref[0]
            r["identical_steps"] += res[1] == ref[1]
            if res[1] != ref[1]:
                r["steps_differ"].append(p.question_id)
            r["tau"].append(res[2])
            if res[0] != ref[0]:
                r["first_diff"][p.question_id] = _first_diff(res[0], ref[0])
        print(f"q{p.question_id} ({p.category}): " + ", ".join(
            f"{n} tau {report['heads'][n]['tau'][-1]:.2f}" for n in drafters), flush=True)

    # hf, loaded back by transformers: the checkpoint's own hf export when its kind has one (a trained
    # standalone drafter), else the untrained first-layers baseline
    n = len(rows)
    if "hf" not in fmts and not hf_baseline:  # nothing for transformers to load
        report["hf"] = None
        report["ok"] = all(r["identical_tokens"] == n and r["identical_steps"] == n for r in report["heads"].values())
        (out / "export_check.json").write_text(json.dumps(report, indent=2, default=str))
        return report
    if "hf" in fmts:
        assistant_dir, baseline, exported = out / "hf", None, None
    else:
        assistant_dir = out / "hf-baseline"
        export(f"first-layers:{drafter_layers}", "hf", assistant_dir, tgt)
        baseline, exported = first_layers_drafter(tgt, drafter_layers), load_drafter(assistant_dir, tgt)
    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, local_files_only=True)
    hf = {"assistant": "checkpoint's hf export" if baseline is None else f"first-layers:{drafter_layers} (untrained)",
          "assisted_equals_target": 0, "ours_identical": 0, "first_diff": {}, "tau_ours": []}
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tgt.tokenizer.pad_token_id)
    for p in rows:
        ids = torch.tensor([p.ids])
        with torch.no_grad():
            plain = tgt.model.generate(ids, **kw)[0, len(p.ids):].tolist()
            assisted = tgt.model.generate(ids, assistant_model=assistant, **kw)[0, len(p.ids):].tolist()
        hf["assisted_equals_target"] += assisted == plain
        if assisted != plain:
            hf["first_diff"][p.question_id] = _first_diff(assisted, plain)
        if baseline is None:  # our decoder from the export was compared with the checkpoint above
            r = report["heads"]["hf"]
            same = p.question_id not in r["first_diff"] and (pruned or p.question_id not in r["steps_differ"])
            hf["ours_identical"] += same
            hf["tau_ours"].append(r["tau"][rows.index(p)])
        else:
            a, b = (_decode(tgt, baseline, p.ids, max_new_tokens, None),
                    _decode(tgt, exported, p.ids, max_new_tokens, None))
            same = a[:2] == b[:2]
            hf["ours_identical"] += same
            hf["tau_ours"].append(b[2])
        print(f"q{p.question_id} hf: assisted {'==' if assisted == plain else '!='} target greedy; ours "
              f"{'identical' if same else 'DIFFERENT'} (tau {hf['tau_ours'][-1]:.2f})", flush=True)
    report["hf"] = hf
    n = len(rows)
    report["ok"] = (all(r["identical_tokens"] == n and (r["identical_steps"] == n or (name == "hf" and pruned))
                        for name, r in report["heads"].items())
                    and hf["assisted_equals_target"] == n and hf["ours_identical"] == n)
    (out / "export_check.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def summary(report: dict) -> str:
    """A small markdown table of the check."""
    n = report["prompts"]
    lines = [f"{n} MT-Bench first turns, {report['max_new_tokens']} new tokens, greedy, tree {report['tree']}", "",
             "| drafter | identical tokens | identical steps | mean tau |", "|---|---|---|---|"]
    for name, r in report["heads"].items():
        lines.append(f"| {name} | {r['identical_tokens']}/{n} | {r['identical_steps']}/{n} | "
                     f"{sum(r['tau']) / len(r['tau']):.3f} |")
    hf = report["hf"]
    if hf is None:
        return "\n".join(lines + ["", "(no hf export for this kind; --hf-baseline checks first-layers:N)", "",
                                   "OK" if report["ok"] else "DIFFERENCES FOUND"])
    lines += ["", f"hf export ({hf.get('assistant', 'first-layers')}): HF generate(assistant_model=export) == "
              f"target greedy on {hf['assisted_equals_target']}/"
              f"{n} (first differing position per prompt: {hf['first_diff'] or 'none'}); our decoder identical from "
              f"the export and its source on {hf['ours_identical']}/{n}", "",
              "OK" if report["ok"] else "DIFFERENCES FOUND"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.export.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafter-layers", type=int, default=4, help="N of the first-layers:N baseline exported as hf")
    ap.add_argument("--tree", default="chain", help="chain, or built:N (a tree saved with the checkpoint)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--hf-baseline", action="store_true",
                    help="for a kind with no hf export: also export first-layers:N to hf and check it with "
                         "transformers' assisted generation")
    ap.add_argument("--out", default="runs/export-check")
    a = ap.parse_args(argv)
    report = check(a.checkpoint, a.out, a.prompts, a.max_new_tokens, a.drafter_layers, a.tree, a.target, a.hf_baseline)
    print(summary(report))
    print(f"wrote {Path(a.out) / 'export_check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
