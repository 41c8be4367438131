"""Draft time per drafted token, verification time per step and tokens/s of standalone drafters side by side.

    python -m benchmarks.draft_time CKPT [CKPT ...] [--prompts 6] [--max-new-tokens 64] [--draft-len 4]
        --out FILE.json

One interleaved greedy run on MT-Bench first turns (1 thread unless --threads): our plain decoding, then
every checkpoint's drafter with its pruned proposal (``renorm``) and, when it has an RDK map, with q_RDK.
Times come from the decoder's own step timers: draft time is divided by the tokens the drafter wrote (every
drafted token, tested or not).
"""

from __future__ import annotations

from collections import defaultdict

from benchmarks.common import add_common_args, parser, setup, write_json
from draftsmith.checkpoint import load_checkpoint
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength


def drafters_of(checkpoints: list[str], t) -> dict:
    """Every checkpoint's drafter, renormalised and (when it has an RDK map) with q_RDK, by name."""
    drafters = {}
    for c in checkpoints:
        m, _ = load_checkpoint(c, t)
        for r in ([False, True] if getattr(m, "rdk", None) is not None else [False]):
            drafters[f"{c}/{'rdk' if r else 'renorm'}"] = m.decoder_drafter(t, t.fingerprint, use_rdk=r)
    return drafters


def main(argv=None) -> dict:
    ap = parser("draft_time", __doc__)
    ap.add_argument("checkpoints", nargs="+")
    add_common_args(ap, threads=True, threads_default=1, out="file")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    a = ap.parse_args(argv)
    bench = setup(a, out_file=True, layout=True, drafters=lambda t: drafters_of(a.checkpoints, t))
    t, drafters = bench.target, bench.drafters
    prompts = bench.prompts(a.prompts)
    decs = {"plain": SpeculativeDecoder(t, None)}
    decs |= {n: SpeculativeDecoder(t, d, policy=FixedLength(a.draft_len)) for n, d in drafters.items()}
    for dec in decs.values():  # warm-up
        dec.generate(prompts[0].ids, 8)
    acc: dict = defaultdict(lambda: defaultdict(float))
    for p in prompts:
        for n, dec in decs.items():
            r = dec.generate(p.ids, a.max_new_tokens)
            s = acc[n]
            s["tokens"] += len(r.tokens)
            s["drafted"] += sum(x.drafted for x in r.steps)
            s["draft_s"] += sum(x.draft_s for x in r.steps)
            s["verify_s"] += sum(x.verify_s for x in r.steps)
            s["steps"] += len(r.steps)
            s["wall"] += sum(x.draft_s + x.verify_s + x.other_s for x in r.steps) + r.prefill_s
    out = {}
    for n, s in acc.items():
        out[n] = {"draft_ms_per_drafted_token": 1000 * s["draft_s"] / s["drafted"] if s["drafted"] else None,
                  "verify_ms_per_step": 1000 * s["verify_s"] / s["steps"], "tokens_per_s": s["tokens"] / s["wall"],
                  "tau": s["tokens"] / s["steps"]}
        print(n, {k: (round(v, 2) if v is not None else None) for k, v in out[n].items()}, flush=True)
    write_json(a.out, {"args": vars(a), "methods": out}, indent=1)
    return out


if __name__ == "__main__":
    main()
