"""Kangaroo: verification from the shallow states (layers l+1..L) against a full-depth verification of
the SAME drafts, paired step by step.

    python -m benchmarks.kangaroo_verify_bench CHECKPOINT [--tree '[[0],[1],[2]]' ...] [--prompts 16]
        [--max-new-tokens 64] [--out FILE]

Greedy decoding with the checkpoint's Kangaroo drafter. At every step, after drafting, both
verifications run on the drafted tree, in an order that alternates step by step: the skip path
(`KangarooDrafter.verify_forward`: the leaves' layers 1..l, then layers l+1..L from the stored states)
and the decoder's own full-depth forward over the same rows. Each is timed in thread CPU time (the
machine is shared; the other core's load does not count). Both write the same cache slots with the same
values up to float rounding; the step then continues from the skip path's logits, and the tokens are
checked against plain greedy decoding. Reported: median ms of each path by number of verified rows,
and the median of the per-step ratio full / skip.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import add_common_args, parser, setup, write_json


def paired_verify_times(dec, prompt: list[int],
                        max_new_tokens: int) -> tuple[list[int], list[tuple[int, float, float]]]:
    """Decode greedily; per step (rows verified, skip ms, full ms), both paths on the same drafts."""
    from draftsmith.engine.sampling import TorchRandom

    drafter = dec.drafter
    rng, rows = TorchRandom(0), []
    state = dec.start(prompt, max_new_tokens)
    k = 0
    while not state.done:
        tree = dec.draft(state, rng)
        times = {}
        for path in (("skip", "full") if k % 2 == 0 else ("full", "skip")):
            if path == "full":
                drafter.verify_forward = None  # the decoder then runs its own full-depth forward
            t0 = time.thread_time()
            out = dec.verify_forward(state, tree)
            times[path] = 1000 * (time.thread_time() - t0)
            if path == "full":
                del drafter.verify_forward  # back to the class's skip path
            else:
                logits, hidden = out
        verdict = dec.verify(state, tree, logits, rng)
        dec.commit(state, tree, verdict, hidden)
        rows.append((tree.n + 1 + (state.prompt_len - 1 if k == 0 else 0), times["skip"], times["full"]))
        k += 1
    return state.tokens[state.prompt_len:], rows


def main(argv: list[str] | None = None) -> dict:
    from draftsmith.checkpoint import drafter_from_checkpoint
    from draftsmith.drafters.kangaroo.decode import KangarooDrafter
    from draftsmith.engine.decoder import SpeculativeDecoder, plain_decoder
    from draftsmith.engine.tree_build import parse_tree

    ap = parser("kangaroo_verify_bench", __doc__)
    ap.add_argument("checkpoint")
    add_common_args(ap, target_default=None, out="file", out_required=False)
    ap.add_argument("--tree", action="append", default=None, help="chain | JSON paths (default: chain); repeatable")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args(argv)

    def kangaroo(target):
        drafter = drafter_from_checkpoint(a.checkpoint, target)
        if not isinstance(drafter, KangarooDrafter):
            raise SystemExit(f"{a.checkpoint} is not a Kangaroo checkpoint")
        return drafter

    bench = setup(a, checkpoint=a.checkpoint, out_file=True, layout=True, drafters=kangaroo)
    target, drafter = bench.target, bench.drafters
    prompts = bench.prompts(a.prompts)
    plain = plain_decoder(target)
    report = {"checkpoint": a.checkpoint, "exit_layer": drafter.exit_layer, "prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "trees": {}}
    for spec in a.tree or ["chain"]:
        dec = SpeculativeDecoder(target, drafter, tree=parse_tree(spec, a.checkpoint))
        steps, equal = [], 0
        for p in prompts:
            toks, rows = paired_verify_times(dec, p.ids, a.max_new_tokens)
            equal += toks == plain.generate(p.ids, a.max_new_tokens).tokens
            steps += rows[1:]  # the first step verifies the whole prompt: left out
        by_rows = {}
        for n, s, f in steps:
            by_rows.setdefault(n, []).append((s, f))
        r = {"steps": len(steps), "greedy_equal_plain": f"{equal}/{len(prompts)}",
             "skip_ms_median": statistics.median(s for _, s, _ in steps),
             "full_ms_median": statistics.median(f for _, _, f in steps),
             "full_over_skip_median": statistics.median(f / s for _, s, f in steps),
             "by_rows": {n: {"steps": len(v), "skip_ms": statistics.median(s for s, _ in v),
                             "full_ms": statistics.median(f for _, f in v)} for n, v in sorted(by_rows.items())}}
        report["trees"][spec] = r
        print(f"{spec}: {r['steps']} steps, skip {r['skip_ms_median']:.1f} ms, full {r['full_ms_median']:.1f} ms "
              f"(median per-step full/skip {r['full_over_skip_median']:.3f}); greedy equal {r['greedy_equal_plain']}; "
              + ", ".join(f"{n} rows: {v['skip_ms']:.1f}/{v['full_ms']:.1f} ms ({v['steps']})"
                          for n, v in r["by_rows"].items()), flush=True)
    if a.out:
        write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
