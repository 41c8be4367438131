"""What one llama.cpp forward costs on this CPU, by GGUF type and by the number of tokens it takes: the price of
verifying a draft block of k+1 tokens against the price of one plain decoding step.

    python -m benchmarks.llamacpp_costs [--types q4_1,bf16,f32] [--threads 1,2] [--tokens 1,2,3,4,5,8]
        [--depth 256] [--gguf EXTRA.gguf ...] --out FILE

``llama-bench`` (the build from scripts/llamacpp_env.sh) runs, per file and thread count: tg128 (plain decoding,
tok/s) and one forward of n tokens at a context depth of ``--depth`` (``-p n -n 0 -d depth``: a verification
after a prompt and some reply). Printed: ms per forward by n and its ratio to the n=1 forward, per file; the
ratio is what speculative decoding pays per step for verifying k+1 tokens, before any drafting. ``--gguf``:
more files (a standalone draft model's, whose tg figure is its cost per drafted token).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from draftsmith.checkpoint import command_line
from draftsmith.export.llamacpp import find_llamacpp, target_gguf
from draftsmith.target import DEFAULT_TARGET, cpu_name, load_target


def bench(ll, model: Path, threads: int, args: list[str], reps: int) -> list[dict]:
    cmd = [str(ll.bin("llama-bench")), "-m", str(model), "-t", str(threads), "-r", str(reps), "-o", "json", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed on {model} (exit {r.returncode}, command {' '.join(cmd)}): "
                         f"{(r.stderr or r.stdout)[-2000:] or 'no output'}")
    return json.loads(r.stdout)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--types", default="q4_1,bf16,f32")
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUF files (e.g. a standalone draft model)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="1,2,3,4,5,8")
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    ll = find_llamacpp()
    target = load_target(a.target)
    files = {t: target_gguf(target, t, ll) for t in a.types.split(",") if t}
    files.update({Path(g).name: Path(g) for g in a.gguf})
    ns = [int(x) for x in a.tokens.split(",")]
    report: dict = {"cpu": cpu_name(), "llamacpp": ll.version, "depth": a.depth, "files": {},
                    "command": command_line()}
    print(f"CPU: {report['cpu']}; llama.cpp {ll.version}; forwards at depth {a.depth}")
    print("| file | threads | tg128 tok/s | ms per forward of n tokens (x the 1-token forward) |")
    print("|---|---|---|---|")
    for name, f in files.items():
        for th in [int(x) for x in a.threads.split(",")]:
            tg = bench(ll, f, th, ["-p", "0", "-n", "128"], a.reps)[0]
            pp = bench(ll, f, th, ["-p", ",".join(map(str, ns)), "-n", "0", "-d", str(a.depth)], a.reps)
            ms = {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in pp}
            row = {"tg128_tok_s": tg["avg_ts"], "tg128_stddev": tg["stddev_ts"], "ms_by_tokens": ms,
                   "x_one_token": {n: ms[n] / ms[ns[0]] for n in ms}, "bytes": f.stat().st_size}
            report["files"][f"{name} t{th}"] = row
            cells = ", ".join(f"{n}: {ms[n]:.1f} ({ms[n] / ms[ns[0]]:.2f}x)" for n in sorted(ms))
            print(f"| {name} | {th} | {tg['avg_ts']:.1f} | {cells} |", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
