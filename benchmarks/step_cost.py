"""Step cost of the target's decoding forward on this machine: a verification over n drafted nodes (n + 1
rows) relative to plain decoding's 1-row step, as `draftsmith trees` measures it to rank trees, and the 1-row
step in milliseconds, for each forward and dtype asked for.

    python -m benchmarks.step_cost [--dtype float32,bfloat16,bfloat16:onednn] [--forward compile,fast,eager]
        [--sizes 3,7] [--threads 1] [--no-autotune] [--rounds 1] [--out FILE]

Each (dtype, forward) is measured in one process; the ratios come from
`draftsmith.engine.tree_build.measure_step_cost` (prefix 256, a 512-slot cache, sizes interleaved, medians
of 21), so they are side by side within each line. ``bfloat16:onednn`` is bf16 with its decoding linears left to
oneDNN's product on a CPU where the native kernel would take them (``DRAFTSMITH_ROWS_LINEAR_BF16=0``, in the same
process). ``float32:padded`` (or ``bfloat16:padded``) pads a chain or tree block up to its row bucket, as decoding
did before fc61918 (``DRAFTSMITH_PAD_BLOCKS=1``, in the same process). ``float32:noprefetch`` (or
``bfloat16:noprefetch``) runs the native row kernels without their weight prefetch, as before it existed
(``DRAFTSMITH_PREFETCH_BYTES=0``, set around that line's measurements in the same process). With ``--rounds N``
(N > 1) every line is compiled first and then measured N times in turn (A, B, A, B, ...), so that lines are side by
side too; each line prints its per-round 1-row times and ratios and their medians. Compile time (the compiled
forward's first calls) is printed with each line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.checkpoint import environment
from draftsmith.engine import native
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.tree_build import measure_step_cost
from draftsmith.target import load_target
from benchmarks.common import write_json
from benchmarks.fastest_plain import cpu_name


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--forward", default="compile", help="comma list of compile, fast, eager")
    ap.add_argument("--sizes", default="3,7", help="drafted nodes per verification (rows - 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-autotune", action="store_true", help="compile without GEMM autotuning")
    ap.add_argument("--rounds", type=int, default=1, help="measure every line this many times in turn, after all "
                    "are compiled (the lines then side by side too)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.sizes.split(",")]
    report = {"cpu": cpu_name(), "threads": a.threads, "sizes": sizes, "lines": [],
              "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads")
    amx = native._CPU_AMX
    ahead = native.set_prefetch_bytes(native.PREFETCH_BYTES) if native.rows_linear_on() else None
    if ahead is not None:
        native.set_prefetch_bytes(ahead)  # the process's setting (DRAFTSMITH_PREFETCH_BYTES), read back

    def prefetch_for(token: str) -> None:
        if ahead is not None:
            native.set_prefetch_bytes(0 if token.endswith(":noprefetch") else ahead)
    lines = []  # (line, target)
    for token in a.dtype.split(","):
        dt, _, linears = token.partition(":")
        if linears not in ("", "onednn", "padded", "noprefetch"):
            raise SystemExit(f"step_cost: unknown variant {linears!r} in --dtype {token!r} (known: onednn, padded, "
                             "noprefetch)")
        for fwd in a.forward.split(","):
            native._CPU_AMX = amx or linears == "onednn"  # read where the forward routes its linears
            target = load_target(a.target, dtype=dt)
            if fwd == "eager":
                apply_cpu_layout(target)
            use_fast_forward(target, fwd, autotune=not a.no_autotune)
            if linears == "padded" and target.fast_body is not None:
                target.fast_body.pad_blocks = True
            prefetch_for(token)
            t0 = time.perf_counter()
            med: dict = {}
            ratios = measure_step_cost(target, sizes, medians_out=med)
            wall = time.perf_counter() - t0
            fast = target.fast_body
            compile_s = round(fast.compile_s, 1) if fast is not None else 0.0
            line = {"dtype": token, "forward": fwd, "autotune": not a.no_autotune,
                    "compile_s": compile_s, "measure_s": round(wall - compile_s, 1),
                    "rounds": [_round(med, sizes, ratios)]}
            if a.rounds <= 1:
                _print(line)
                lines.append((line, None))  # the target is freed before the next line loads
            else:
                print(f"{token:9s} {fwd:8s} compiled in {compile_s} s", flush=True)
                lines.append((line, target))
            del target
    for _ in range(1, a.rounds):
        for line, target in lines:
            native._CPU_AMX = amx or line["dtype"].endswith(":onednn")
            prefetch_for(line["dtype"])
            med = {}
            ratios = measure_step_cost(target, sizes, medians_out=med)
            line["rounds"].append(_round(med, sizes, ratios))
    native._CPU_AMX = amx
    prefetch_for("")
    for line, _ in lines:
        rounds = line["rounds"]
        line["one_row_ms"] = round(statistics.median(r["one_row_ms"] for r in rounds), 2)
        line["x_one_row"] = {k: round(statistics.median(r["x_one_row"][k] for r in rounds), 3)
                             for k in rounds[0]["x_one_row"]}
        report["lines"].append(line)
        if a.rounds > 1:
            _print(line)
    if a.out:
        write_json(a.out, report, indent=1)
    return report


def _round(med: dict, sizes: list[int], ratios: dict) -> dict:
    """One measurement of a line: the 1-row step in ms and each size's ratio to it."""
    return {"one_row_ms": round(med[1] * 1000, 2),
            "x_one_row": {str(s + 1): round(r, 3) for s, r in zip(sizes, ratios.values())}}


def _print(line: dict) -> None:
    rows = ", ".join(f"{k} rows x{v}" for k, v in line["x_one_row"].items())
    n = len(line["rounds"])
    per = "" if n == 1 else "; 1-row ms by round " + " ".join(str(r["one_row_ms"]) for r in line["rounds"])
    print(f"{line['dtype']:9s} {line['forward']:8s} 1 row {line['one_row_ms']:.1f} ms; {rows}"
          f"{' (medians of ' + str(n) + ' rounds)' if n > 1 else ''}; compile {line['compile_s']} s{per}", flush=True)


if __name__ == "__main__":
    main()
