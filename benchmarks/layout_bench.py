"""What the CPU decoding layout buys, measured side by side in one run.

    python -m benchmarks.layout_bench [--rows 1 2 3 5 9] [--prefix 300] [--repeats 20]

Two copies of the target, one with PyTorch's default layout and one with
`draftsmith.engine.cpu_layout`; for each block size (rows: 1 for plain
decoding, K+1 for verifying K drafted tokens) the copies alternate, each
forward running over a pre-allocated cache of ``--prefix`` committed
positions and projecting every row through the LM head the way the decoder
does (`draftsmith.engine.drafters.project`). Prints the median milliseconds
of each and their ratio, and the largest logit difference between the
copies. Timings are for this machine only; nothing here is a test.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from benchmarks.common import add_common_args, parser, setup, write_json
from draftsmith.engine.cache_kw import cache_arg


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    from draftsmith.checkpoint import environment
    from draftsmith.engine.cpu_layout import cpu_decode_layout
    from draftsmith.engine.drafters import project
    from draftsmith.engine.kvcache import KVCache, prefix_block_mask

    ap = parser("layout_bench", __doc__)
    add_common_args(ap, out="file", out_required=False)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    target = setup(a, out_file=True).target
    if next(target.model.parameters()).device.type != "cpu":
        raise SystemExit("the CPU decoding layout only applies to CPU targets")
    models = {"default": target.model, "cpu_layout": copy.deepcopy(target.model)}
    cpu_decode_layout(models["cpu_layout"])
    g = torch.Generator().manual_seed(0)
    V = target.vocab_size
    prefix = torch.randint(0, V, (1, a.prefix), generator=g)
    block = torch.randint(0, V, (1, max(a.rows)), generator=g)
    caches = {}
    for name, m in models.items():
        caches[name] = KVCache.for_model(m, a.prefix + max(a.rows) + 1)
        caches[name].set_write(0)
        m.get_decoder()(input_ids=prefix, **cache_arg(m.get_decoder(), caches[name]), use_cache=True)

    def forward(name: str, q: int) -> torch.Tensor:
        m, cache = models[name], caches[name]
        cache.set_write(a.prefix)
        mask = None if q == 1 else prefix_block_mask(
            a.prefix, torch.ones(q, q, dtype=torch.bool).tril(), torch.float32)
        h = m.get_decoder()(input_ids=block[:, :q], position_ids=torch.arange(a.prefix, a.prefix + q)[None],
                            attention_mask=mask, **cache_arg(m.get_decoder(), cache),
                            use_cache=True).last_hidden_state[0]
        return project(m.get_output_embeddings(), h)

    rows = []
    for q in a.rows:
        diff = (forward("default", q) - forward("cpu_layout", q)).abs().max().item()
        times = {n: [] for n in models}
        for _ in range(a.repeats):
            for n in models:  # alternate, so noise hits both alike
                t0 = time.perf_counter()
                forward(n, q)
                times[n].append(1e3 * (time.perf_counter() - t0))
        d, c = statistics.median(times["default"]), statistics.median(times["cpu_layout"])
        rows.append({"rows": q, "default_ms": d, "cpu_layout_ms": c, "speedup": d / c, "max_logit_diff": diff})
        print(f"{q:>2} rows: default {d:6.1f} ms  cpu_layout {c:6.1f} ms  -> {d / c:.2f}x   "
              f"max |logit diff| {diff:.1e}", flush=True)
    out = {"prefix": a.prefix, "repeats": a.repeats, "threads": torch.get_num_threads(), "rows": rows,
           "environment": environment()}
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
