"""Prove drafters in llama.cpp: each exported to GGUF, served by ``llama-server`` with the target's GGUF, decoded
greedily against llama.cpp without it and against our plain decoding.

    python -m draftsmith.export.llamacpp_check CKPT [CKPT ...] --prompts 80 --max-new-tokens 128 --draft-len 3 \\
        --gguf-types f32,q8_0,q4_1 --target-types q4_1,f32 [--ngram ngram-simple,ngram-map-k] [--threads 2] \\
        [--prompts-file FILE | --humaneval N --samples S] --out DIR

For every target file (``--target-types``: q4_1 is the file the default target ships as) and every drafter
format (``--gguf-types``), on MT-Bench first turns (or HumanEval prompts, or your own), one request at a time:
  * llama.cpp's tokens with the drafter against llama.cpp without it on the same file (losslessness inside
    llama.cpp), and against our plain decoding (equal on the F32 file up to float noise; the 4-bit file is
    another model's arithmetic), divergences with our target's top-2 logit gap where they first differ;
  * llama.cpp's mean acceptance length (1 + accepted / drafts, its own counters) against our decoder's with the
    same drafter and chain length, and accepted tokens per draft position;
  * tok/s with and without the drafter, and the ratio to llama.cpp plain on the same file: the speedup a
    llama.cpp user gets;
  * the cost: ms per step with the drafter, against ms per plain token.
``--ngram TYPES`` adds llama.cpp's own n-gram drafting (no drafter file) as more runs. ``--humaneval N
--samples S``: the first N HumanEval problems, each asked S times in a row (sampled at ``--temperature``;
n-gram and suffix drafting gain from the repetition), where token equality is not asked for (sampling), only
acceptance and speed. Writes DIR/llamacpp_check.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftsmith.checkpoint import command_line, drafter_from_checkpoint, environment
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.fastpath import add_forward_arg, use_fast_forward
from draftsmith.export import source_target
from draftsmith.export.llamacpp import LlamaCppError, export_gguf, find_llamacpp, target_gguf
from draftsmith.export.llamacpp_server import LlamaServer, run_prompts
from draftsmith.export.vllm_check import compare, ours
from draftsmith.eval.mtbench import mtbench_prompts, user_prompts
from draftsmith.eval.humaneval import humaneval_prompt_ids
from draftsmith.target import DEFAULT_TARGET, cpu_name, dtype_name, load_target


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.export.llamacpp_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="*", help="drafter checkpoints (EAGLE-3, standalone)")
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns, spread over the categories")
    ap.add_argument("--prompts-file", default=None, help="a JSONL of your own prompts (as `draftsmith eval`)")
    ap.add_argument("--humaneval", type=int, default=0, help="use the first N HumanEval problems instead")
    ap.add_argument("--samples", type=int, default=1, help="--humaneval: requests per problem, in a row")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (token equality is checked)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=3, help="chain length, ours and llama.cpp's")
    ap.add_argument("--gguf-types", default="f32,q8_0,q4_1", help="drafter weight formats")
    ap.add_argument("--target-types", default="q4_1,f32", help="target files (q4_1: the shipped file)")
    ap.add_argument("--ngram", default="", help="llama.cpp n-gram spec types to add, comma-separated")
    ap.add_argument("--no-ours", action="store_true", help="leave out our decoder (llama.cpp only)")
    ap.add_argument("--threads", type=int, default=2)
    add_forward_arg(ap)
    ap.add_argument("--target", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        ll = find_llamacpp()
    except LlamaCppError as e:
        raise SystemExit(str(e)) from None
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(a.target or (source_target(a.checkpoint[0]) if a.checkpoint else DEFAULT_TARGET))
    n, k = a.max_new_tokens, a.draft_len
    skipped: dict = {}
    if a.humaneval:
        prompts = humaneval_prompt_ids(target.tokenizer, a.humaneval, a.samples)
    elif a.prompts_file:
        rows, skipped = user_prompts(target.tokenizer, a.prompts_file, a.prompts)
        prompts = [p.ids for p in rows]
    else:
        prompts = [p.ids for p in mtbench_prompts(target.tokenizer, a.prompts, spread=True)]
    room = min(2048, target.context_length) - n - k - 1
    long = sum(len(p) > room for p in prompts)
    prompts = [p for p in prompts if len(p) <= room]
    skipped = {**dict(skipped), "longer than the context allows": long}
    if long:
        print(f"skipped {long} prompts longer than {room} tokens")
    if not prompts:
        raise SystemExit(f"no prompt fits in {room} tokens")
    greedy = a.temperature == 0
    gtypes = [t for t in a.gguf_types.split(",") if t]
    ttypes = [t for t in a.target_types.split(",") if t]
    report: dict = {"cpu": cpu_name(), "threads": a.threads, "llamacpp": ll.version, "target": target.name,
                    "fingerprint": target.fingerprint, "prompts": len(prompts), "prompts_skipped": skipped,
                    "prompt_set": "humaneval" if a.humaneval else a.prompts_file or "mt-bench",
                    "samples": a.samples, "temperature": a.temperature, "max_new_tokens": n, "draft_len": k,
                    "plain": {}, "runs": {}, "command": command_line(), "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads; llama.cpp {ll.version}; {len(prompts)} prompts x {n}")

    def serve(tf: Path, name: str, **kw) -> dict:
        extra = [] if greedy else ["--temp", a.temperature]
        with LlamaServer(tf, threads=a.threads, draft_max=k, log=out / f"{name}.server.log", ll=ll,
                         extra=extra, **kw) as s:
            t0 = time.perf_counter()
            r = run_prompts(s, prompts, n, temperature=a.temperature)
            r["elapsed_s"] = time.perf_counter() - t0
        print(f"  {name}: {r['tok_s']:.2f} tok/s" + (f", acceptance length {1 + r['accepted'] / r['drafts']:.3f}"
                                                      if r.get("drafts") else ""), flush=True)
        return r

    files = {t: target_gguf(target, t, ll) for t in ttypes}
    plain_ll = {t: serve(files[t], f"plain-{t}") for t in ttypes}
    for t in ttypes:
        report["plain"][f"llama.cpp {t}"] = {"tok_s": plain_ll[t]["tok_s"], "decode_tok_s": plain_ll[t]["decode_tok_s"],
                                             "file": files[t].name}
    plain_ours, mine_drafters = None, {}
    if not a.no_ours and greedy:
        mine_drafters = {ck: drafter_from_checkpoint(ck, target) for ck in a.checkpoint}
        apply_cpu_layout(target, *mine_drafters.values())
        fwd = use_fast_forward(target, a.forward)["forward"]
        for d in [None, *mine_drafters.values()]:  # compiling happens here, outside the clock
            ours(target, d, prompts[:1], 8, k)
        plain_ours = ours(target, None, prompts, n, k)
        report["plain"][f"ours ({dtype_name(target.dtype)}, {fwd} forward)"] = {
            "tok_s": plain_ours["generated"] / plain_ours["wall_s"]}
        for t in ttypes:
            report["plain"][f"llama.cpp {t}"]["equal_to_ours"] = compare(target, prompts, plain_ll[t]["tokens"],
                                                                         plain_ours["tokens"])

    def record(name: str, r: dict, t: str, extra: dict) -> None:
        base = plain_ll[t]
        row = {**extra, "target_file": files[t].name, "tok_s": r["tok_s"],
               "x_llamacpp_plain": r["tok_s"] / base["tok_s"],
               "mean_acceptance_length": 1 + r["accepted"] / r["drafts"] if r["drafts"] else None,
               "drafts": r["drafts"], "drafted": r["drafted"], "accepted": r["accepted"],
               "accepted_per_position": r["accepted_per_position"],
               "decode_tok_s": r["decode_tok_s"], "decode_x_llamacpp_plain": r["decode_tok_s"] / base["decode_tok_s"],
               # decoding only (llama.cpp's own timings, prompt processing left out)
               "ms_per_step": r["decode_ms"] / r["drafts"] if r["drafts"] else None,
               "ms_per_plain_token": base["decode_ms"] / base["generated"]}
        if greedy:
            row["equal_to_llamacpp_plain"] = compare(target, prompts, r["tokens"], base["tokens"])
            if plain_ours is not None:
                row["equal_to_ours_plain"] = compare(target, prompts, r["tokens"], plain_ours["tokens"])
        report["runs"][name] = row

    for ck in a.checkpoint:
        mine = None
        if not a.no_ours and greedy:
            mine = ours(target, mine_drafters[ck], prompts, n, k)
            print(f"  ours {ck}: acceptance length {mine['mean_acceptance_length']:.3f}", flush=True)
        for g in gtypes:
            where = out / f"{Path(ck).parent.name}-{g}"
            if not (where / "export.json").exists():
                export_gguf(ck, where, target, g, target_file=files[ttypes[0]], threads=a.threads)
            exp = json.loads((where / "export.json").read_text())
            for t in ttypes:
                name = f"{Path(ck).parent.name} {g} on {t}"
                r = serve(files[t], name.replace(" ", "-"), draft=where / exp["file"], spec_type=exp["spec_type"])
                extra = {"checkpoint": str(ck), "gguf_type": g, "draft_bytes": exp["bytes"]}
                if mine is not None:
                    extra.update(ours_mean_acceptance_length=mine["mean_acceptance_length"],
                                 ours_tok_s=mine["generated"] / mine["wall_s"],
                                 ours_accepted_per_position=mine["accepted_per_position"], ours_drafts=mine["drafts"])
                record(name, r, t, extra)
    for ng in [x for x in a.ngram.split(",") if x]:
        for t in ttypes:
            name = f"{ng} on {t}"
            record(name, serve(files[t], name.replace(" ", "-"), spec_type=ng), t, {"spec_type": ng})
    report["recommendation"] = recommend(report)
    (out / "llamacpp_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(report))
    for t, rec in report["recommendation"].items():
        print(f"recommended for {t}: {rec['choice']} ({rec['why']})")
    return report


def recommend(report: dict, max_parted: float = 0.1) -> dict:
    """Per target file: the drafter and format that decoded fastest (prompts included), if it beat llama.cpp's
    plain decoding of that file and, greedy, left llama.cpp's plain tokens on all but ``max_parted`` of the
    prompts (a batch of k+1 tokens rounds differently from one token in llama.cpp, so a few near-ties part
    from plain decoding on every drafter; many mean the speed is bought with other outputs); else plain
    decoding."""
    out = {}
    for t in {r["target_file"] for r in report["runs"].values()}:
        runs = {n: r for n, r in report["runs"].items() if r["target_file"] == t}
        parted = {n: 1 - r["equal_to_llamacpp_plain"]["equal"] / r["equal_to_llamacpp_plain"]["of"]
                  for n, r in runs.items() if r.get("equal_to_llamacpp_plain")}
        ok = {n: r for n, r in runs.items() if parted.get(n, 0.0) <= max_parted}
        left_out = sorted(set(runs) - set(ok))
        note = (f"; left out for parting from plain decoding on more than {max_parted:.0%} of the prompts: "
                + ", ".join(f"{n} ({parted[n]:.0%})" for n in left_out)) if left_out else ""
        if not ok:
            out[t] = {"choice": "no drafter (plain decoding)", "x_llamacpp_plain": 1.0, "why": note.lstrip("; ")}
            continue
        best = max(ok, key=lambda n: ok[n]["x_llamacpp_plain"])
        r = ok[best]
        if r["x_llamacpp_plain"] > 1.0:
            out[t] = {"choice": best, "x_llamacpp_plain": r["x_llamacpp_plain"],
                      "why": f"{r['x_llamacpp_plain']:.2f}x llama.cpp's plain decoding of {t}{note}"}
        else:
            out[t] = {"choice": "no drafter (plain decoding)", "x_llamacpp_plain": 1.0,
                      "why": f"the best, {best}, is {r['x_llamacpp_plain']:.2f}x plain: its step costs "
                             f"{_num(r['ms_per_step'], '.1f')} ms for {_num(r['mean_acceptance_length'])} tokens, "
                             f"a plain token {r['ms_per_plain_token']:.1f} ms{note}"}
    return out


def _eq(e: dict | None) -> str:
    return f"{e['equal']}/{e['of']}" if e else "-"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def table(report: dict) -> str:
    lines = [f"CPU: {report['cpu']}; {report['threads']} threads; {report['prompts']} prompts x "
             f"{report['max_new_tokens']}; draft length {report['draft_len']}", "",
             "| plain | tok/s (prompt included) | decoding only | greedy = ours |", "|---|---|---|---|"]
    for name, p in report["plain"].items():
        eq = p.get("equal_to_ours")
        lines.append(f"| {name} | {p['tok_s']:.2f} | {_num(p.get('decode_tok_s'), '.2f')} | {_eq(eq)} |")
    lines += ["", "| run | tok/s (x llama.cpp plain) | decoding only: tok/s (x plain) | acc. length llama.cpp / ours | "
              "ms/step (plain ms/token) | = llama.cpp plain | = ours plain |", "|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        lines.append(f"| {name} | {r['tok_s']:.2f} ({r['x_llamacpp_plain']:.2f}x) | {r['decode_tok_s']:.2f} "
                     f"({r['decode_x_llamacpp_plain']:.2f}x) | "
                     f"{_num(r['mean_acceptance_length'])} / {_num(r.get('ours_mean_acceptance_length'))} | "
                     f"{_num(r['ms_per_step'], '.1f')} ({r['ms_per_plain_token']:.1f}) | "
                     f"{_eq(r.get('equal_to_llamacpp_plain'))} | {_eq(r.get('equal_to_ours_plain'))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
