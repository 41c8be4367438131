"""One bf16 decoding linear, side by side in one process: torch's ``F.linear`` (oneDNN), the native ``rows_linear``
(VDPBF16PS in the kernels' AVX512_BF16 build) and ``rows_linear_widened`` (bf16 widened to float32), at the default
target's weight shapes and a few row counts; medians of ``--calls`` calls each, interleaved per shape.

    python -m benchmarks.rows_linear_bench [--threads 2] [--rows 1,4,16,100] [--calls 40] [--step]
        [--pages [--dtypes bfloat16,float32]] [--out FILE]

A shape timed in a loop reads a weight that stays in the caches. ``--step`` times what a decoding step does
instead: the 121 products of one forward of the default target in order (30 layers of q+k+v, o, gate+up and down,
then the LM head; 270 MB of bf16 weights, each its own tensor, so each read comes from memory), for each backend
in turn over ``--calls`` rounds, medians; torch's product there is its eager ``F.linear`` (a compiled graph may
choose inductor's own GEMM template instead).

``--pages``: the same step through the native kernel only, its weights once on the usual 4 KiB pages and once
moved to 2 MiB pages (`draftsmith.engine.hugepages`, what the decoding forward does), in turn each round, for
each of ``--dtypes``: the TLB's share of a step that streams its weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_json
from benchmarks.fastest_plain import cpu_name
from draftsmith.engine import hugepages
from draftsmith.engine.native import native_status, rows_linear_on

SHAPES = [(49152, 576), (3072, 576), (576, 1536), (960, 576)]  # LM head, gate+up, down, q+k+v
STEP = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # one forward's products, in order


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
    ap.add_argument("--step", action="store_true", help="one forward's 121 products in order, weights from memory")
    ap.add_argument("--pages", action="store_true",
                    help="--step through the kernel on 4 KiB pages against 2 MiB pages, side by side")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="--pages: the weights' dtypes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not rows_linear_on():
        raise SystemExit(f"the native kernels are not available here: {native_status()['why']}")
    op, widened = torch.ops.draftsmith_native.rows_linear, torch.ops.draftsmith_native.rows_linear_widened
    print(f"CPU: {cpu_name()}; {a.threads} threads; kernels {native_status()}")
    rows = []
    g = torch.Generator().manual_seed(0)
    if a.pages:
        return _pages(a, op, g)
    if a.step:
        return _step(a, op, widened, g)
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


def _step(a, op, widened, g) -> dict:
    ws = [torch.randn(n, k, generator=g).bfloat16() for n, k in STEP]
    mb = sum(w.numel() * 2 for w in ws) / 1e6
    backends = {"torch": lambda x, w: F.linear(x, w), "kernel": lambda x, w: op(x, w, None),
                "widened": lambda x, w: widened(x, w, None)}
    out = {"cpu": cpu_name(), "threads": a.threads, "kernels": native_status(), "weights_mb": round(mb, 1),
           "step": []}
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in STEP}}
        times: dict[str, list[float]] = {b: [] for b in backends}
        for rnd in range(a.calls + 2):
            for name, f in backends.items():
                t = time.perf_counter()
                for w in ws:
                    f(xs[w.shape[1]], w)
                if rnd >= 2:
                    times[name].append(time.perf_counter() - t)
        med = {b: statistics.median(v) * 1e3 for b, v in times.items()}
        out["step"].append({"rows": m, **{f"{b}_ms": round(v, 3) for b, v in med.items()}})
        print(f"one forward's products, {m:3d} rows ({mb:.0f} MB): torch {med['torch']:.2f} ms, kernel "
              f"{med['kernel']:.2f} ({mb / med['kernel']:.1f} GB/s), widened {med['widened']:.2f}; torch / kernel "
              f"x{med['torch'] / med['kernel']:.2f}")
    if a.out:
        write_json(a.out, out)
    return out


def _pages(a, op, g) -> dict:
    why = hugepages.why_not()
    if why is not None:
        raise SystemExit(f"no huge pages to compare with: {why}")
    out = {"cpu": cpu_name(), "threads": a.threads, "kernels": native_status(), "thp": hugepages.thp_setting(),
           "pages": []}
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        ws = [torch.randn(n, k, generator=g).to(dtype) for n, k in STEP]
        placed = hugepages.to_huge_pages(ws)
        mb = sum(w.numel() * w.element_size() for w in ws) / 1e6
        huge = placed.huge_bytes()
        for m in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, k in STEP}}
            times: dict[str, list[float]] = {"4k": [], "2m": []}
            for rnd in range(a.calls + 2):
                order = (("4k", ws), ("2m", placed.tensors))
                for name, wl in order if rnd % 2 else order[::-1]:
                    t = time.perf_counter()
                    for w in wl:
                        op(xs[w.shape[1]], w, None)
                    if rnd >= 2:
                        times[name].append(time.perf_counter() - t)
            med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
            row = {"dtype": dt, "rows": m, "weights_mb": round(mb, 1),
                   "huge_mb": None if huge is None else round(huge / 1e6, 1),
                   "ms_4k": round(med["4k"], 3), "ms_2m": round(med["2m"], 3),
                   "ratio_4k_over_2m": round(med["4k"] / med["2m"], 3)}
            out["pages"].append(row)
            print(f"{dt}, one forward's products, {m:3d} rows ({mb:.0f} MB, {row['huge_mb']} MB in huge pages): "
                  f"4 KiB pages {med['4k']:.2f} ms ({mb / med['4k']:.1f} GB/s), 2 MiB pages {med['2m']:.2f} ms "
                  f"({mb / med['2m']:.1f} GB/s); x{row['ratio_4k_over_2m']:.3f}")
        del ws, placed
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
