"""One bf16 decoding linear, side by side in one process: torch's ``F.linear`` (oneDNN), the native ``rows_linear``
(VDPBF16PS in the kernels' AVX512_BF16 build) and ``rows_linear_widened`` (bf16 widened to float32), at the default
target's weight shapes and a few row counts; medians of ``--calls`` calls each, interleaved per shape.

    python -m benchmarks.rows_linear_bench [--threads 2] [--rows 1,4,16,100] [--calls 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_json
from benchmarks.fastest_plain import cpu_name
from draftsmith.engine.native import native_status, rows_linear_on

SHAPES = [(49152, 576), (3072, 576), (576, 1536), (960, 576)]  # LM head, gate+up, down, q+k+v


def _ms(f, calls: int) -> float:
    f()
    f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,100")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not rows_linear_on():
        raise SystemExit(f"the native kernels are not available here: {native_status()['why']}")
    op, widened = torch.ops.draftsmith_native.rows_linear, torch.ops.draftsmith_native.rows_linear_widened
    print(f"CPU: {cpu_name()}; {a.threads} threads; kernels {native_status()}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).bfloat16()
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = _ms(lambda: F.linear(x, w), a.calls)
            dot = _ms(lambda: op(x, w, None), a.calls)
            wid = _ms(lambda: widened(x, w, None), a.calls)
            rows.append({"out": n, "in": k, "rows": m, "torch_ms": ref, "kernel_ms": dot, "widened_ms": wid})
            print(f"{n} x {k}, {m:3d} rows: torch {ref:.3f} ms, kernel {dot:.3f}, widened {wid:.3f}; "
                  f"torch / kernel x{ref / dot:.2f}")
    out = {"cpu": cpu_name(), "threads": a.threads, "kernels": native_status(), "rows": rows}
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
