"""The data engine's decode attention alone: the native ragged kernel against masked SDPA, and optionally against
another version of the kernel's source, on caches shaped like the default target's.

Every layer of a decode step reads its own cache, so a step reads 30 caches in turn, each once: "cold" times
that (the caches of ``--layers`` layers, each called once per pass), "warm" calls one layer's cache
``--layers`` times. Rows attend to a random number of slots in [--min-slots, --max-slots). Each figure is the
best of three passes of three; the ops alternate, so each ratio is measured side by side.

``--compare-source FILE``: build FILE (say ``git show REV:engine/csrc/ragged_attention.cpp > FILE``) as a
second op under its own namespace, with the same flags as the installed build, and time it beside the current
one; its largest difference from the current kernel's output is printed too.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import add_common_args, parser, write_json
from benchmarks.fastest_plain import cpu_name
from draftsmith.checkpoint import environment
from draftsmith.engine import native
from draftsmith.engine.native import masked_decode_attention, native_available, native_status


def _build_other(source: Path):
    """The kernel in ``source`` as the op ``draftsmith_compare::ragged_decode_attention``."""
    from torch.utils.cpp_extension import load

    text = re.sub(r"TORCH_LIBRARY(_IMPL)?\(draftsmith_native", r"TORCH_LIBRARY\1(draftsmith_compare",
                  source.read_text())
    out = Path(torch.utils.cpp_extension._get_build_directory("draftsmith_compare", False)) / "compare.cpp"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    _, cflags = native.build_flags(native._capability(), native_status()["bf16_dot"])
    load(name="draftsmith_compare", sources=[str(out)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    return torch.ops.draftsmith_compare.ragged_decode_attention


def main(argv: list[str] | None = None) -> dict:
    ap = parser("attention_bench", __doc__)
    add_common_args(ap, target=False, threads=True, threads_default=2, seed=True, out="file", out_required=False)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--min-slots", type=int, default=40)
    ap.add_argument("--max-slots", type=int, default=300)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--compare-source", type=Path, default=None, metavar="FILE")
    ap.add_argument("--no-sdpa", action="store_true", help="leave masked SDPA out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not native_available():
        sys.exit(f"the native kernel is not available here: {native_status()['why']}")
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    b, nk, d = args.rows, args.kv_heads, args.head_dim
    last = torch.randint(args.min_slots, args.max_slots, (b,), generator=g)
    ks = [torch.randn(b, nk, args.capacity, d, generator=g).to(dt) for _ in range(args.layers)]
    vs = [torch.randn(b, nk, args.capacity, d, generator=g).to(dt) for _ in range(args.layers)]
    q = torch.randn(b, args.heads, d, generator=g).to(dt)
    scale = d ** -0.5
    ops = {"native": torch.ops.draftsmith_native.ragged_decode_attention}
    if args.compare_source is not None:
        ops["compare"] = _build_other(args.compare_source)
    if not args.no_sdpa:
        ops["masked SDPA"] = masked_decode_attention
    mb = int((last + 1).sum()) * nk * d * 2 * ks[0].element_size() / 1e6

    def run(op, layers: list[int], reps: int = 3) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            for i in layers:
                op(q, ks[i], vs[i], last, scale)
        return (time.perf_counter() - t0) / reps / len(layers)

    cold_order, warm_order = list(range(args.layers)), [0] * args.layers
    for op in ops.values():
        run(op, cold_order, 1)
    best = {n: {"cold_ms": float("inf"), "warm_ms": float("inf")} for n in ops}
    for _ in range(3):
        for n, op in ops.items():
            best[n]["cold_ms"] = min(best[n]["cold_ms"], run(op, cold_order) * 1e3)
            best[n]["warm_ms"] = min(best[n]["warm_ms"], run(op, warm_order) * 1e3)
    ref = ops["native"](q, ks[0], vs[0], last, scale).float()
    res = {"cpu": cpu_name(), "environment": environment(), "native": native_status(),
           "threads": torch.get_num_threads(),
           "shape": vars(args) | {"compare_source": str(args.compare_source)}, "mb_per_layer": round(mb, 2),
           "ops": best}
    print(f"{res['cpu']}; {args.dtype}; {b} rows of {args.min_slots}-{args.max_slots} slots, "
          f"{mb:.1f} MB of keys and values a layer; {torch.get_num_threads()} threads; native: {native_status()}")
    for n, f in best.items():
        diff = ""
        if n != "native":
            got = ops[n](q, ks[0], vs[0], last, scale).float()
            diff = f"; max |difference| from native {(got - ref).abs().max():.2e}"
        print(f"  {n}: {f['cold_ms']:.3f} ms a layer cold ({mb / f['cold_ms']:.1f} GB/s), {f['warm_ms']:.3f} ms "
              f"warm; cold time / native's: {f['cold_ms'] / best['native']['cold_ms']:.2f}x{diff}")
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
