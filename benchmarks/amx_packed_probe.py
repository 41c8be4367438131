"""Would bf16 products on AMX that read the packed 4-bit weights make verification cheap? A probe.

The default target's float32 decoding reads its weights packed (4-bit Q4_1 blocks, the 8-bit head) and is the
fastest plain decoding on a CPU with AMX; a verification of 8 rows costs about 2.1 single steps there, because a
float32 step is bound by its multiply-adds. bf16 verifies 8 rows for about 1.3 single bf16 steps (AMX), but reads
the full bf16 weights. This probe builds an AMX kernel (benchmarks/csrc/amx_packed_probe.cpp) that widens the
packed blocks to bf16 tiles and multiplies them with 1-16 rows, and times every linear of the target's step
(30 layers x 7 products and the head, each weight read once a pass, so from memory) three ways, interleaved:
the float32 kernel over packed weights (`rows_linear_q`), the probe, and torch's bf16 product over bf16 weights.
It also checks that a row's outputs do not depend on the rows beside it.

    python -m benchmarks.amx_packed_probe --threads 2 --out runs/amx_probe.json

Needs a CPU with AMX (amx_tile, amx_bf16) and a C++ compiler; refuses otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import add_common_args, parser, write_json
from draftsmith.engine import native
from draftsmith.engine.blockquant import pack
from draftsmith.target import cpu_name, load_target

SRC = Path(__file__).parent / "csrc" / "amx_packed_probe.cpp"
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile",
         "-mamx-bf16", "-mfma"]


def has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " amx_tile" in flags and " amx_bf16" in flags


def median_ms(f, reps: int) -> float:
    for _ in range(2):
        f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def main(argv: list[str] | None = None) -> dict:
    ap = parser("amx_packed_probe", __doc__)
    add_common_args(ap, threads=True, threads_default=2, out="file")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    if not has_amx():
        raise SystemExit("amx_packed_probe: this CPU has no AMX (amx_tile, amx_bf16)")
    if not native.native_available():
        raise SystemExit(f"amx_packed_probe: the native kernels do not load: {native.native_status()}")
    from torch.utils import cpp_extension
    cpp_extension.load(name="draftsmith_amx_probe", sources=[str(SRC)], extra_cflags=FLAGS,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    torch.set_num_threads(a.threads)
    model = load_target(a.target).model
    lins = [lin for layer in model.model.layers for lin in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    weights = [(lin.weight.detach().float().contiguous(), 4) for lin in lins]
    weights.append((model.lm_head.weight.detach().float().contiguous(), 8))
    packed = [pack(w, bits) for w, bits in weights]
    if any(p is None for p in packed):
        raise SystemExit("amx_packed_probe: the target's weights are not all exact 4-bit/8-bit blocks")
    bf16 = [w.to(torch.bfloat16) for w, _ in weights]
    probe = torch.ops.draftsmith_amx_probe.qbf
    same_alone = True
    for (w, _), p in zip(weights[:8], packed[:8]):
        x = torch.randn(16, w.shape[1]).to(torch.bfloat16)
        same_alone &= torch.equal(probe(x, p.q, p.d, p.m, p.bits, None)[3], probe(x[3:4], p.q, p.d, p.m, p.bits,
                                                                                  None)[0])

    def step(kind: str, rows: int):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w, _ in weights}}
        xb = {k: v.to(torch.bfloat16) for k, v in xs.items()}

        def run():
            for (w, _), p, wb in zip(weights, packed, bf16):
                k = w.shape[1]
                if kind == "float32, packed (rows_linear_q)":
                    torch.ops.draftsmith_native.rows_linear_q(xs[k], p.q, p.d, p.m, p.bits, None)
                elif kind == "bf16 from packed, AMX (probe)":
                    probe(xb[k], p.q, p.d, p.m, p.bits, None)
                else:
                    F.linear(xb[k], wb)
        return run

    kinds = ["float32, packed (rows_linear_q)", "bf16 from packed, AMX (probe)", "bf16, torch's product"]
    times: dict = {}
    for _ in range(a.rounds):
        for rows in a.rows:
            for kind in kinds:
                times.setdefault(kind, {}).setdefault(rows, []).append(median_ms(step(kind, rows), a.reps))
    base = min(times[kinds[0]][1]) if 1 in a.rows else None
    table = {kind: {rows: min(v) for rows, v in by.items()} for kind, by in times.items()}
    print(f"every linear of one step ({len(weights)} products), ms, {a.threads} threads, {cpu_name()}:")
    for kind, by in table.items():
        cells = "  ".join(f"{r} rows {ms:.2f}" + (f" (x{ms / base:.2f})" if base else "") for r, ms in by.items())
        print(f"  {kind:32s} {cells}")
    print(f"  a row's outputs alone = beside 15 others (probe): {same_alone}")
    report = {"cpu": cpu_name(), "threads": a.threads, "target": a.target, "products": len(weights),
              "ms": table, "x_float32_packed_1_row": base and {k: {r: ms / base for r, ms in by.items()}
                                                              for k, by in table.items()},
              "row_alone_equal": bool(same_alone)}
    if a.out:
        write_json(Path(a.out), report)
    return report


if __name__ == "__main__":
    main()
