"""Packed K-quant weights against the same decoding without them, side by side in one process.

    python -m benchmarks.packed_ab --target gemma-3-270m [--prompts 8] [--max-new-tokens 64] [--threads 2]
        [--out FILE]

A target converted from a GGUF file whose down and output projections are Q4_K or Q6_K (the named targets' "Q4_K_M"
files) gets those weights packed from the file (`fastpath._Core._k_quant_packs`). This loads the target twice in
float32, once with them (``k-packed``) and once with ``DRAFTSMITH_PACKED_K=0`` (``control``: the other packs only),
both on the compiled forward, and decodes the same MT-Bench first turns greedily with each, alternating which goes
first per round (two rounds). Printed: the packed groups and the bytes a step reads for each, tok/s, and how many
outputs are equal (the packed kernel gives the float32 kernel's bits, so all of them should be).
"""

from __future__ import annotations

import os
import time

import torch

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.target import cpu_name, load_target
from benchmarks.common import add_common_args, parser, setup, write_json


def main(argv=None) -> dict:
    ap = parser("packed_ab", __doc__)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    add_common_args(ap, threads=True, threads_default=2, out="file", out_required=False)
    b = setup(ap.parse_args(argv), out_file=True, load=False)
    a = b.args
    decoders, report = {}, {"target": a.target, "cpu": cpu_name(), "threads": a.threads, "methods": {}}
    before = os.environ.get("DRAFTSMITH_PACKED_K")
    try:
        for tag, flag in (("k-packed", "1"), ("control", "0")):
            os.environ["DRAFTSMITH_PACKED_K"] = flag  # read when the fast forward packs its weights
            tgt = load_target(a.target, dtype=torch.float32)
            use_fast_forward(tgt, "compile")
            fb = tgt.fast_body
            report["methods"][tag] = {"packed": fb.packed, "step_mb": round(fb.step_bytes() / 1e6, 1)}
            print(f"{tag}: packed {fb.packed}, {fb.step_bytes() / 1e6:.0f} MB of weights read a step", flush=True)
            decoders[tag] = SpeculativeDecoder(tgt)
    finally:
        if before is None:
            os.environ.pop("DRAFTSMITH_PACKED_K", None)
        else:
            os.environ["DRAFTSMITH_PACKED_K"] = before
    prompts = [p.ids for p in mtbench_prompts(tgt.tokenizer, a.prompts, spread=True)]
    for dec in decoders.values():  # compile both before any timing
        dec.generate(prompts[0], 8)
    tokens = {k: 0 for k in decoders}
    seconds = {k: 0.0 for k in decoders}
    outs: dict[str, list] = {k: [] for k in decoders}
    for rnd in range(2):
        for p in prompts:
            order = list(decoders) if rnd == 0 else list(reversed(decoders))
            for k in order:
                t = time.perf_counter()
                res = decoders[k].generate(p, a.max_new_tokens)
                seconds[k] += time.perf_counter() - t
                tokens[k] += len(res.tokens)
                outs[k].append(list(res.tokens))
    for k in decoders:
        report["methods"][k]["tok_s"] = round(tokens[k] / seconds[k], 2)
    report["speedup"] = round(report["methods"]["k-packed"]["tok_s"] / report["methods"]["control"]["tok_s"], 3)
    report["equal_outputs"] = sum(x == y for x, y in zip(outs["k-packed"], outs["control"]))
    report["outputs"] = len(outs["control"])
    print(f"{report['cpu']}, {a.threads} threads, float32, {a.prompts} MT-Bench first turns x {a.max_new_tokens}, "
          "2 rounds")
    for k, m in report["methods"].items():
        print(f"  {k:9s} {m['tok_s']:7.2f} tok/s, {m['step_mb']:.0f} MB a step, packed {m['packed']}")
    print(f"  k-packed / control: {report['speedup']}x; equal outputs {report['equal_outputs']}/{report['outputs']}")
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
