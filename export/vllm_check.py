"""Prove exports in vLLM: each drafter vLLM serves, exported, loaded by vLLM on the same target, decoded greedily.

    python -m draftsmith.export.vllm_check CKPT [CKPT ...] --prompts 80 --max-new-tokens 128 --draft-len 3 \\
        --out DIR [--vllm-python .venv-vllm/bin/python] [--threads 1]

For every checkpoint and every format of it vLLM loads (``vllm-eagle3`` as method ``eagle3``, ``vllm-dflash`` as
``dflash``, ``vllm-medusa`` as ``medusa``, ``hf`` as ``draft_model``), on MT-Bench first turns, one request at a
time (a DFlash block in vLLM is the newest token and K mask tokens, so ``--draft-len`` should be its block size
minus one, the block it was trained on and our decoder drafts from):
  * vLLM's tokens with the drafter against vLLM without one and against our plain decoding (divergences
    counted, with the target's top-2 logit gap at the first differing position: a near tie means float
    noise, not a bug);
  * vLLM's mean acceptance length (1 + accepted / drafts, its own counters) against our decoder's with the
    same drafter and chain length (1 + accepted / drafting steps), and both per position;
  * vLLM's tok/s with and without the drafter, ours with and without it.
vLLM runs in its own environment (scripts/vllm_env.sh builds it) through ``export/vllm_worker.py``.
Writes DIR/vllm_check.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.checkpoint import command_line, drafter_from_checkpoint, environment
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.eval.bench import add_plain
from draftsmith.eval.greedy_equality import first_divergence, top2_gap
from draftsmith.eval.mtbench import mtbench_prompts, user_prompts
from draftsmith.export import export, formats_for, load_source, source_target
from draftsmith.target import dtype_name, load_target

WORKER = Path(__file__).with_name("vllm_worker.py")
#: our format -> vLLM's speculative method
VLLM_METHODS = {"vllm-eagle3": "eagle3", "vllm-dflash": "dflash", "vllm-medusa": "medusa", "hf": "draft_model"}
DEFAULT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def vllm_python(path: str | None = None) -> Path | None:
    """The vLLM environment's interpreter, or None when it is not built (no interpreter, or no vllm in it)."""
    p = Path(path) if path else DEFAULT_PYTHON
    built = any(p.parent.parent.glob("lib/python3*/site-packages/vllm/__init__.py"))
    return p if p.exists() and built else None


def run_vllm(python: Path, target_dir: str, prompts: list[list[int]], max_tokens: int, out: Path,
             speculative: dict | None = None, threads: int = 1, timeout: float = 3600,
             max_model_len: int = 2048, extra: dict | None = None) -> dict:
    """One vLLM process: generate greedily for every prompt; returns the worker's JSON. ``extra``: more job
    keys (``enforce_eager``, ``dtype``, ``batched``: see export/vllm_worker.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    job = out.with_suffix(".job.json")
    job.write_text(json.dumps({"target": str(target_dir), "prompts": prompts, "max_tokens": max_tokens,
                               "speculative_config": speculative, "threads": threads,
                               "max_model_len": max_model_len, **(extra or {})}))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    iomp = sorted(python.parent.parent.glob("lib/libiomp5.so"))
    if iomp:  # vLLM's CPU speculative decoding asks for Intel's OpenMP runtime
        env["LD_PRELOAD"] = str(iomp[0])
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        r = subprocess.run([str(python), str(WORKER), str(job), str(out)], stdout=f, stderr=subprocess.STDOUT,
                           env=env, timeout=timeout)
    if r.returncode != 0 or not out.exists():
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"vLLM worker failed (exit {r.returncode}); its log {log} ends with:\n{tail}")
    return json.loads(out.read_text())


def add_vllm_plain(figures: dict, target, prompts: list, max_new_tokens: int, out: Path, sampling=None,
                   threads: int | None = None) -> str | None:
    """vLLM CPU's plain decoding of the same prompts (its own process, one request at a time, after ours: not
    interleaved), in the target's dtype, as method ``vLLM plain`` of ``figures``; every method's speedups then
    name it too. Returns the name, or None with ``figures["vllm"]`` saying why (no vLLM environment, sampling:
    measured greedy only, a target that is not a model directory, or vLLM's failure). ``out``: its job and log."""
    python = vllm_python()
    why = None
    if python is None:
        why = "no vLLM environment (bash scripts/vllm_env.sh builds it)"
    elif sampling is not None and not sampling.greedy:
        why = "vLLM plain decoding is measured greedy only"
    elif not (Path(str(target.path)) / "config.json").exists():
        why = f"the target {target.name} is not a model directory vLLM can load"
    if why:
        figures["vllm"] = why
        return None
    threads = threads or torch.get_num_threads()
    ids = [p.ids if hasattr(p, "ids") else list(p) for p in prompts]
    room = max(2048, max(len(i) for i in ids) + max_new_tokens + 8)
    try:
        res = run_vllm(python, str(target.path), ids, max_new_tokens, out, threads=threads, max_model_len=room,
                       extra={"dtype": dtype_name(target.dtype), "enforce_eager": False})
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:  # its failure costs its column only
        figures["vllm"] = str(e).splitlines()[0]
        return None
    cats = sorted({getattr(p, "category", "all") for p in prompts})
    add_plain(figures, "vLLM plain", {"tokens_per_s": res["generated"] / res["wall_s"] if res["wall_s"] else 0.0,
                                      "family": "vllm", "tokens": res["generated"], "wall_s": res["wall_s"],
                                      "threads": threads, "tau_by_category": {c: 1.0 for c in cats}})
    return "vLLM plain"


def ours(target, drafter, prompts: list[list[int]], max_new_tokens: int, k: int) -> dict:
    dec = SpeculativeDecoder(target, drafter, policy=FixedLength(k) if drafter is not None else None)
    tokens, steps, t0 = [], [], time.perf_counter()
    for p in prompts:
        r = dec.generate(p, max_new_tokens)
        tokens.append(list(r.tokens))
        steps += r.steps
    wall = time.perf_counter() - t0
    drafting = [s for s in steps if s.drafted]
    per_pos = [sum(1 for s in drafting if s.accepted >= i) for i in range(1, k + 1)]
    return {"tokens": tokens, "wall_s": wall, "generated": sum(map(len, tokens)),
            "mean_acceptance_length": 1 + sum(s.accepted for s in drafting) / max(len(drafting), 1),
            "drafts": len(drafting), "accepted_per_position": per_pos}


def compare(target, prompts: list[list[int]], a: list[list[int]], b: list[list[int]]) -> dict:
    """Divergences between two greedy outputs per prompt, with the target's top-2 gap where they first differ."""
    div = []
    for p, x, y in zip(prompts, a, b):
        i = first_divergence(x, y)
        if i is not None:
            div.append({"position": i, "top2_gap": top2_gap(target, p + x[:i])})
    return {"equal": len(prompts) - len(div), "of": len(prompts), "divergences": div}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.export.vllm_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="+")
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns, spread over the categories")
    ap.add_argument("--prompts-file", default=None, help="a JSONL of your own prompts instead of MT-Bench (as for "
                    "`draftsmith eval --prompts-file`)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=3, help="chain length, ours and vLLM's")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: .venv-vllm/bin/python)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    python = vllm_python(a.vllm_python)
    if python is None:
        raise SystemExit("no vLLM environment: run `bash scripts/vllm_env.sh` (or pass --vllm-python)")
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(source_target(a.checkpoint[0], a.target))
    n, k = a.max_new_tokens, a.draft_len
    if a.prompts_file:
        rows, skipped = user_prompts(target.tokenizer, a.prompts_file, a.prompts)
    else:
        rows, skipped = mtbench_prompts(target.tokenizer, a.prompts, spread=True), {}
    room = target.context_length - n - k - 1  # a prompt must leave room for the reply and a draft block
    prompts = [p.ids for p in rows if len(p.ids) <= room]
    skipped = {**dict(skipped), "longer than the context allows": len(rows) - len(prompts)}
    if skipped["longer than the context allows"]:
        print(f"skipped {skipped['longer than the context allows']} prompts longer than {room} tokens "
              f"(context {target.context_length} - {n} new tokens - a draft block of {k + 1})")
    if not prompts:
        raise SystemExit(f"no prompt fits: every one is longer than {room} tokens")
    report: dict = {"target": {"name": target.name, "path": str(target.path), "fingerprint": target.fingerprint},
                    "prompts": len(prompts), "prompts_skipped": skipped, "max_new_tokens": n, "draft_len": k,
                    "runs": {},
                    "command": command_line(), "environment": environment()}
    plain_ours = ours(target, None, prompts, n, k)
    ctx = min(2048, target.context_length)
    plain_vllm = run_vllm(python, str(target.path), prompts, n, out / "vllm-plain.json", threads=a.threads,
                          max_model_len=ctx)
    report["plain"] = {"ours_tok_s": plain_ours["generated"] / plain_ours["wall_s"],
                       "vllm_tok_s": plain_vllm["generated"] / plain_vllm["wall_s"],
                       "vllm_vs_ours": compare(target, prompts, plain_vllm["tokens"], plain_ours["tokens"])}
    for ck in a.checkpoint:
        src = load_source(ck, target)
        for fmt in [f for f in formats_for(src) if f in VLLM_METHODS]:
            where = out / f"{Path(ck).parent.name}-{fmt}"
            if not where.exists():
                export(ck, fmt, where, target)
            why = vllm_refuses(python, target, VLLM_METHODS[fmt])
            if why is not None:
                print(f"{where.name}: not run: {why}", flush=True)
                report["runs"][where.name] = {"checkpoint": str(ck), "format": fmt, "vllm_method": VLLM_METHODS[fmt],
                                              "refused": why}
                continue
            mine = ours(target, drafter_from_checkpoint(ck, target), prompts, n, k)
            spec = {"method": VLLM_METHODS[fmt], "model": str(where), "num_speculative_tokens": k}
            theirs = run_vllm(python, str(target.path), prompts, n, out / f"{where.name}.json", spec, a.threads,
                              max_model_len=ctx)
            s = theirs["spec"]
            drafts = s.get("num_drafts", 0)
            report["runs"][where.name] = {
                "checkpoint": str(ck), "format": fmt, "vllm_method": VLLM_METHODS[fmt],
                "vllm_vs_vllm_plain": compare(target, prompts, theirs["tokens"], plain_vllm["tokens"]),
                "vllm_vs_ours_plain": compare(target, prompts, theirs["tokens"], plain_ours["tokens"]),
                "ours_vs_ours_plain": compare(target, prompts, mine["tokens"], plain_ours["tokens"]),
                "vllm_mean_acceptance_length": 1 + s.get("num_accepted_tokens", 0) / drafts if drafts else None,
                "ours_mean_acceptance_length": mine["mean_acceptance_length"],
                "vllm_accepted_per_position": s.get("num_accepted_tokens_per_pos"),
                "ours_accepted_per_position": mine["accepted_per_position"],
                "vllm_drafts": drafts, "ours_drafts": mine["drafts"],
                "vllm_tok_s": theirs["generated"] / theirs["wall_s"], "ours_tok_s": mine["generated"] / mine["wall_s"],
                "vllm_speedup_vs_vllm_plain": (theirs["generated"] / theirs["wall_s"]) / report["plain"]["vllm_tok_s"],
                "ours_speedup_vs_ours_plain": (mine["generated"] / mine["wall_s"]) / report["plain"]["ours_tok_s"]}
    (out / "vllm_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    return report


_SUPPORT_PROBE = """\
import sys
import vllm
from vllm.model_executor.models import ModelRegistry, interfaces
cls = ModelRegistry._try_load_model_cls(sys.argv[1])
print("unknown" if cls is None else int(bool(getattr(interfaces, sys.argv[2])(cls))), vllm.__version__)
"""
#: vLLM's method -> (its check of a target model class, the interface it names): methods that need the target's help
_TARGET_INTERFACE = {VLLM_METHODS[f]: ("supports_eagle3", "SupportsEagle3") for f in ("vllm-eagle3", "vllm-dflash")}


def vllm_refuses(python: Path, target, method: str) -> str | None:
    """Why the vLLM at ``python`` cannot serve a ``method`` drafter for ``target``, read from its own model classes
    before a run (vLLM itself fails only after loading, with a traceback); None when it can or cannot tell."""
    if method not in _TARGET_INTERFACE:
        return None
    check, interface = _TARGET_INTERFACE[method]
    arch = (getattr(target.model.config, "architectures", None) or [type(target.model).__name__])[0]
    try:
        r = subprocess.run([str(python), "-c", _SUPPORT_PROBE, arch, check], capture_output=True, text=True,
                           timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = r.stdout.split()
    if r.returncode != 0 or len(words) < 2 or words[-2] != "0":
        return None
    return (f"vLLM {words[-1]}'s {arch} does not implement vLLM's {interface} interface: that vLLM cannot serve "
            f"a {method} drafter for this target (export kept; another vLLM version may)")


def table(report: dict) -> str:
    p = report["plain"]
    lines = [f"plain: vLLM {p['vllm_tok_s']:.2f} tok/s, ours {p['ours_tok_s']:.2f} tok/s; vLLM = ours on "
             f"{p['vllm_vs_ours']['equal']}/{p['vllm_vs_ours']['of']}",
             "| run | vLLM = vLLM plain | vLLM = ours plain | acc. length vLLM / ours | vLLM tok/s (x plain) | "
             "ours tok/s (x plain) |", "|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        if "refused" in r:
            lines.append(f"| {name} | not run: {r['refused']} | | | | |")
            continue
        va, oa = r["vllm_mean_acceptance_length"], r["ours_mean_acceptance_length"]
        lines.append(f"| {name} | {r['vllm_vs_vllm_plain']['equal']}/{r['vllm_vs_vllm_plain']['of']} | "
                     f"{r['vllm_vs_ours_plain']['equal']}/{r['vllm_vs_ours_plain']['of']} | "
                     f"{'-' if va is None else f'{va:.3f}'} / {oa:.3f} | {r['vllm_tok_s']:.2f} "
                     f"({r['vllm_speedup_vs_vllm_plain']:.2f}x) | {r['ours_tok_s']:.2f} "
                     f"({r['ours_speedup_vs_ours_plain']:.2f}x) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
