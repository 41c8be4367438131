"""What processing the draft buys: acceptance with penalties and a logit bias, the draft processed like the target
(what the server does) or left raw (still lossless: only the target's side must be exact), and without processors.

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.processors_acceptance \\
        --checkpoint runs/quickstart/final --out runs/processors_acceptance.json
"""

from __future__ import annotations

from benchmarks.common import add_common_args, parser, setup, write_json
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.processors import Penalties, RequestProcessing
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.tree_build import parse_tree


def main(argv: list[str] | None = None) -> dict:
    ap = parser("processors_acceptance", __doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tree", default="built:4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--tree-only", action="store_true", help="skip the chain")
    add_common_args(ap, threads=True, threads_default=1, seed=True, out="file", out_required=False)
    b = setup(ap.parse_args(argv), out_file=True, layout=False)
    a, target = b.args, b.target
    drafter = drafter_from_checkpoint(a.checkpoint, target)
    tree = parse_tree(a.tree, a.checkpoint)
    prompts = [p.ids for p in b.prompts(a.prompts)]
    pen = Penalties(frequency=1.0, presence=0.5, repetition=1.3, logit_bias=((28, -3.0), (30, 2.0)))
    report: dict = {"checkpoint": a.checkpoint, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                    "penalties": {"frequency": pen.frequency, "presence": pen.presence, "repetition": pen.repetition,
                                  "logit_bias": dict(pen.logit_bias)}, "runs": {}}
    for temp in a.temperature:
        shapes = [(a.tree, tree)] if a.tree_only else [("chain", None), (a.tree, tree)]
        for shape_name, shape in shapes:
            for setting in ("no processors", "draft processed", "draft raw"):
                dec = SpeculativeDecoder(target, drafter, tree=shape, sampling=SamplingParams(temp))
                drafted = accepted = forwards = tokens = 0
                for i, p in enumerate(prompts):
                    dec.processing = None if setting == "no processors" else \
                        RequestProcessing(pen, process_draft=setting == "draft processed")
                    r = dec.generate(p, a.max_new_tokens, seed=a.seed + i)
                    drafted += sum(s.drafted for s in r.steps)
                    accepted += sum(s.accepted for s in r.steps)
                    forwards += len(r.steps)
                    tokens += len(r.tokens)
                key = f"T={temp} {shape_name} {setting}"
                report["runs"][key] = {"tau": tokens / forwards, "accepted": accepted, "drafted": drafted,
                                       "tokens": tokens, "forwards": forwards}
                print(f"{key:40s} tau {tokens / forwards:.3f} accepted {accepted} of {drafted} drafted", flush=True)
    if b.out:
        write_json(b.out, report)
    return report


if __name__ == "__main__":
    main()
