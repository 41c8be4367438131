"""Share of decoding time spent outside the model forwards.

    python -m benchmarks.step_breakdown CHECKPOINT [--tree built:4] [--drafter-layers 4]
        [--draft-len 4] [--prompts 4] [--max-new-tokens 128] [--temperature 0] [--out FILE]

The report's draft/verify/other shares time the decoder's phases; the
acceptance walk and tree growth sit inside the draft and verify phases. This
script times the forwards themselves: every outermost ``nn.Module`` call
(target body, drafter model, heads) and every LM-head product
(`draftsmith.engine.drafters.project`), and reports what is left of the
steps' wall time: sampling, acceptance, tree growth, cache compaction and
Python. Methods: our decoder with the checkpoint's drafter (one row per
``--tree``) and with the target's first ``--drafter-layers`` layers.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import add_common_args, parser, setup, write_json


class ForwardClock:
    """Adds up the wall time of outermost module calls and LM-head products while installed."""

    def __init__(self):
        self.seconds, self._depth = 0.0, 0

    def _wrap(self, fn):
        clock = self

        def timed(*args, **kwargs):
            if clock._depth:
                return fn(*args, **kwargs)
            clock._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock._depth -= 1
        return timed

    def __enter__(self):
        import draftsmith.engine.decoder as dec_mod
        import draftsmith.engine.drafters as dr_mod

        self._saved = (torch.nn.Module.__call__, dec_mod.project, dr_mod.project)
        torch.nn.Module.__call__ = self._wrap(torch.nn.Module.__call__)
        dec_mod.project = self._wrap(dec_mod.project)
        dr_mod.project = self._wrap(dr_mod.project)
        return self

    def __exit__(self, *exc):
        import draftsmith.engine.decoder as dec_mod
        import draftsmith.engine.drafters as dr_mod

        torch.nn.Module.__call__, dec_mod.project, dr_mod.project = self._saved


def main(argv: list[str] | None = None) -> dict:
    from draftsmith.checkpoint import drafter_from_checkpoint, environment
    from draftsmith.engine.decoder import SpeculativeDecoder
    from draftsmith.drafters.standalone.decode import first_layers_drafter
    from draftsmith.engine.policies import FixedLength
    from draftsmith.engine.sampling import SamplingParams, TorchRandom
    from draftsmith.engine.tree_build import parse_tree

    ap = parser("step_breakdown", __doc__)
    ap.add_argument("checkpoint")
    add_common_args(ap, target=False, cpu_layout=True, out="file", out_required=False)
    ap.add_argument("--tree", action="append", default=None, help="tree of the checkpoint's drafter: chain | "
                    "built:B | dynamic[:B,D,W] | JSON paths | JSON file; repeatable, one row each (default: chain)")
    ap.add_argument("--drafter-layers", type=int, default=4)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args(argv)
    bench = setup(a, checkpoint=a.checkpoint, out_file=True,
                  drafters=lambda t: [drafter_from_checkpoint(a.checkpoint, t),
                                      first_layers_drafter(t, a.drafter_layers)])
    target, (heads, small) = bench.target, bench.drafters
    sampling = SamplingParams(temperature=a.temperature)
    decoders = {f"{heads.name} {spec}": SpeculativeDecoder(target, heads, tree=parse_tree(spec, a.checkpoint),
                                                           sampling=sampling)
                for spec in (a.tree or ["chain"])}
    decoders[f"first-{a.drafter_layers}-layers K={a.draft_len}"] = SpeculativeDecoder(
        target, small, policy=FixedLength(a.draft_len), sampling=sampling)
    prompts = bench.prompts(a.prompts)
    rows = {}
    for name, dec in decoders.items():
        dec.generate(prompts[0].ids, 8, seed=0)  # warm-up
        step_s = fwd_s = 0.0
        steps = 0
        for i, p in enumerate(prompts):
            state, rng = dec.start(p.ids, a.max_new_tokens), TorchRandom(i)
            with ForwardClock() as clock:  # the steps only, as the report's time shares
                while not state.done:
                    dec.step(state, rng)
            step_s += sum(s.draft_s + s.verify_s + s.other_s for s in state.steps)
            fwd_s += clock.seconds
            steps += len(state.steps)
        outside = max(step_s - fwd_s, 0.0)
        rows[name] = {"steps": steps, "step_ms": 1e3 * step_s / steps, "forward_ms": 1e3 * fwd_s / steps,
                      "outside_ms": 1e3 * outside / steps, "outside_share": outside / step_s}
        print(f"{name:<28} {rows[name]['step_ms']:7.1f} ms/step  forwards {rows[name]['forward_ms']:7.1f} ms  "
              f"outside {rows[name]['outside_ms']:5.2f} ms = {100 * rows[name]['outside_share']:.1f}%", flush=True)
    out = {"checkpoint": a.checkpoint, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
           "temperature": a.temperature, "cpu_layout": a.cpu_layout, "methods": rows, "environment": environment()}
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
