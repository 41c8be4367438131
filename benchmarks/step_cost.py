"""Step cost of the target's decoding forward on this machine: a verification over n drafted nodes (n + 1
rows) relative to plain decoding's 1-row step, as `draftsmith trees` measures it to rank trees, and the 1-row
step in milliseconds, for each forward and dtype asked for.

    python -m benchmarks.step_cost [--dtype float32,bfloat16] [--forward compile,fast,eager] [--sizes 3,7]
        [--threads 1] [--no-autotune] [--out FILE]

Each (dtype, forward) is measured in one process, one after the other; the ratios come from
`draftsmith.engine.tree_build.measure_step_cost` (prefix 256, a 512-slot cache, sizes interleaved, medians
of 9), so they are side by side within each line. Compile time (the compiled forward's first calls) is
printed with each line.
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.checkpoint import environment
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
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.sizes.split(",")]
    report = {"cpu": cpu_name(), "threads": a.threads, "sizes": sizes, "lines": [],
              "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads")
    for dt in a.dtype.split(","):
        target = load_target(a.target, dtype=dt)
        for fwd in a.forward.split(","):
            if fwd == "eager":
                apply_cpu_layout(target)
            use_fast_forward(target, fwd, autotune=not a.no_autotune)
            t0 = time.perf_counter()
            med: dict = {}
            ratios = measure_step_cost(target, sizes, medians_out=med)
            wall = time.perf_counter() - t0
            fast = target.fast_body
            compile_s = round(fast.compile_s, 1) if fast is not None else 0.0
            one = med[1] * 1000
            line = {"dtype": dt, "forward": fwd, "autotune": not a.no_autotune, "one_row_ms": round(one, 2),
                    "x_one_row": {str(s + 1): round(r, 3) for s, r in zip(sizes, ratios.values())},
                    "compile_s": compile_s, "measure_s": round(wall - compile_s, 1)}
            report["lines"].append(line)
            rows = ", ".join(f"{k} rows x{v}" for k, v in line["x_one_row"].items())
            print(f"{dt:9s} {fwd:8s} 1 row {line['one_row_ms']:.1f} ms; {rows}; compile {compile_s} s", flush=True)
    if a.out:
        write_json(a.out, report, indent=1)
    return report


if __name__ == "__main__":
    main()
