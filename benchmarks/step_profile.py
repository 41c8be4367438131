"""Where one compiled decoding step of the target goes, on this machine: profiled, grouped, and set against the
time it takes to read the step's weights.

    python -m benchmarks.step_profile [--target smollm2-135m-instruct] [--threads 2] [--rows 1,4] [--prefix 256]
        [--steps 20] [--dtype float32|bfloat16] [--out FILE]

For each row count: the median wall time of the step (the compiled forward, LM head included, after a
``--prefix``-token prompt in a 512-slot cache, as `draftsmith trees` measures steps), then torch's profiler over
``--steps`` steps, its self times grouped as
  * linears: the weight products (``draftsmith_native::rows_linear`` or the BLAS/oneDNN products);
  * attention: the native decode kernel or SDPA;
  * compiled code: inductor's own kernels (norms, RoPE, SiLU, residual adds, cache writes);
  * guards: dynamo's check that the compiled graph applies;
  * other: the rest (allocation, views, Python).
The floor is the bytes of weights one forward reads over this machine's read bandwidth (a 1 GiB sum).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import add_common_args, parser, write_json
from benchmarks.fastest_plain import forward_bytes, read_bandwidth
from draftsmith.checkpoint import environment
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.native import native_status, rows_linear_on
from draftsmith.target import cpu_name, load_target

GROUPS = (("linears", ("rows_linear", "aten::mm", "aten::addmm", "mkldnn", "mkl_linear", "aten::linear")),
          ("attention", ("ragged_decode_attention", "block_attention", "scaled_dot_product", "flash_attention")),
          ("compiled code", ("CompiledFxGraph",)),
          ("guards", ("Cache Lookup",)))


def group_of(name: str) -> str:
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "other"


def main(argv=None) -> dict:
    ap = parser("step_profile", __doc__)
    add_common_args(ap, target_default="smollm2-135m-instruct", threads=True, threads_default=2, out="file",
                    out_required=False)
    ap.add_argument("--rows", default="1,4", help="comma list of rows per step")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = load_target(a.target, dtype=a.dtype)
    use_fast_forward(target, "compile")
    fast, model = target.fast_body, target.model
    rows = [int(r) for r in a.rows.split(",")]
    for r in rows:
        fast.reserve(r)
    cache = KVCache.for_model(model, 512)
    ids = torch.randint(0, target.vocab_size, (1, a.prefix + max(rows)), generator=torch.Generator().manual_seed(0))
    cache.set_write(0)
    fast(input_ids=ids[:, :a.prefix], cache=cache)

    def step(n: int) -> None:
        m = prefix_block_mask(a.prefix, torch.ones(n, n, dtype=torch.bool).tril(), fast.dtype)
        cache.set_write(a.prefix)
        fast(input_ids=ids[:, a.prefix:a.prefix + n], position_ids=torch.arange(a.prefix, a.prefix + n)[None],
             attention_mask=m, cache=cache)

    report = {"cpu": cpu_name(), "threads": a.threads, "dtype": a.dtype, "prefix": a.prefix, "native": native_status(),
              "rows_linear": rows_linear_on(), "steps": {}, "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads; {a.dtype}")
    for n in rows:
        for _ in range(3):
            step(n)
        walls = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step(n)
            walls.append(time.perf_counter() - t0)
        with torch.profiler.profile() as prof:
            for _ in range(a.steps):
                step(n)
        groups: dict[str, float] = {}
        for ev in prof.key_averages():
            g = group_of(ev.key)
            groups[g] = groups.get(g, 0.0) + ev.self_cpu_time_total / 1000 / a.steps
        line = {"wall_ms": round(statistics.median(walls) * 1000, 2),
                "profiled_ms": {g: round(v, 2) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])}}
        report["steps"][str(n)] = line
    # the floor last: reading a 1 GiB tensor before the steps slowed the compiled code's own kernels 3x here
    # the bytes a step reads: the packed copies where the target's weights are exact 4/8-bit blocks
    nbytes = fast.step_bytes() if getattr(fast, "packed", None) else forward_bytes(model)
    floor_ms = nbytes / read_bandwidth(a.threads) * 1000
    report["floor_ms"] = round(floor_ms, 2)
    print(f"the weights' read floor: {floor_ms:.1f} ms a step")
    for n, line in report["steps"].items():
        parts = ", ".join(f"{g} {v}" for g, v in line["profiled_ms"].items())
        line["x_floor"] = round(line["wall_ms"] / floor_ms, 2)
        print(f"{n} rows: {line['wall_ms']} ms a step ({line['x_floor']}x the floor); profiled ms a step: {parts}")
    if a.out:
        write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
