"""The batched decoder (the server's), side by side on the same prompts, greedy: with a drafter, its verification
through the model's own forward against the fused batched step; and plain, the fused step on a copy of its own in
float32 weights against the single decoder's shared fused weights with their exact 4-bit copies.

    python -m benchmarks.batched_verify --checkpoint runs/quickstart/final --batch 8 --prompts 16 \
        --max-new-tokens 64 --k 3 --threads 2 --out runs/onestep/batched_verify.json

Both runs use the same target with our compiled forward on it (`use_fast_forward`); "own forward" sets the
decoder's forward to the model's own (what draft verification, prefills and every step of a drafting decoder
ran before the fused step verified blocks), "fused" keeps the fused batched step (`FastBatchBody`: prefills,
plain steps and `verify`). Groups of ``--batch`` prompts run through both in turn, the order alternating per
group, after one warm-up group each. "plain, own float32 copy" is plain batched decoding on a `FastBatchBody` of
its own without packed weights (what the server's plain steps ran before the batched step shared the single
decoder's core); "plain, shared packed" is `plain_batched_decoder` now. Printed: tok/s (prefill included), tau,
each method's speedup over the first, rows equal to the first's.
"""

from __future__ import annotations

import time

from benchmarks.common import add_common_args, parser, provenance, setup, write_json
from draftsmith.checkpoint import resolve_drafter
from draftsmith.engine.batched import BatchedSpeculativeDecoder, plain_batched_decoder
from draftsmith.engine.fast_batch import FastBatchBody
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.target import cpu_name


def main(argv=None) -> None:
    ap = parser("batched_verify", __doc__)
    ap.add_argument("--checkpoint", required=True, help="a drafter checkpoint or a decoder-only spec")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    add_common_args(ap, threads=True, threads_default=2, cpu_layout=True, out="file")
    a = ap.parse_args(argv)
    bench = setup(a, checkpoint=a.checkpoint, out_file=True, drafters=lambda t: resolve_drafter(a.checkpoint, t))
    target, drafter = bench.target, bench.drafters
    use_fast_forward(target, "compile")
    prompts = [p.ids for p in mtbench_prompts(target.tokenizer, a.prompts + a.batch, spread=True)]
    warm, prompts = prompts[:a.batch], prompts[a.batch:]
    decs = {"own forward": BatchedSpeculativeDecoder(target, drafter, k=a.k),
            "fused": BatchedSpeculativeDecoder(target, drafter, k=a.k)}
    decs["own forward"].forward = "eager"
    own = FastBatchBody(target.model, compile=True, pack=False)
    decs["plain, own float32 copy"] = plain_batched_decoder(target)
    decs["plain, own float32 copy"]._fast = lambda: own
    decs["plain, shared packed"] = plain_batched_decoder(target)
    for d in decs.values():
        d.generate(warm, a.max_new_tokens)
    acc = {n: {"tokens": 0, "wall_s": 0.0, "row_forwards": 0, "rows": []} for n in decs}
    groups = [prompts[i:i + a.batch] for i in range(0, len(prompts), a.batch)]
    for gi, grp in enumerate(groups):
        order = list(decs) if gi % 2 == 0 else list(reversed(list(decs)))
        for n in order:
            t0 = time.perf_counter()
            res = decs[n].generate(grp, a.max_new_tokens)
            acc[n]["wall_s"] += time.perf_counter() - t0
            acc[n]["tokens"] += sum(len(r.tokens) for r in res.rows)
            acc[n]["row_forwards"] += res.row_forwards
            acc[n]["rows"] += [r.tokens for r in res.rows]
    out = {**provenance(), "cpu": cpu_name(), "threads": a.threads, "checkpoint": str(a.checkpoint), "batch": a.batch,
           "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "k": a.k, "methods": {}}
    base = acc["own forward"]
    for n, x in acc.items():
        tps = x["tokens"] / x["wall_s"]
        out["methods"][n] = {"tok_s": tps, "tau": x["tokens"] / x["row_forwards"],
                             "x_own_forward": tps / (base["tokens"] / base["wall_s"]),
                             "rows_equal_own_forward": sum(r == s for r, s in zip(x["rows"], base["rows"]))}
    pf = out["methods"]["plain, shared packed"]
    pf["x_own_float32_copy"] = pf["tok_s"] / out["methods"]["plain, own float32 copy"]["tok_s"]
    print(f"CPU: {out['cpu']}; {a.threads} threads; batch {a.batch}; {len(prompts)} MT-Bench first turns x "
          f"{a.max_new_tokens}; chain k={a.k}; {a.checkpoint}")
    for n, m in out["methods"].items():
        print(f"  {n:24s} {m['tok_s']:7.2f} tok/s  tau {m['tau']:.2f}  x{m['x_own_forward']:.2f}  "
              f"rows equal {m['rows_equal_own_forward']}/{len(prompts)}")
    print(f"  plain: shared packed x{pf['x_own_float32_copy']:.2f} the own float32 copy")
    write_json(a.out, out)


if __name__ == "__main__":
    main()
