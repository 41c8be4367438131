"""The simulator against measured runs on this machine: calibrate, decode, replay, compare.

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.sim_validate runs/quickstart/final \
        --data runs/quickstart/data/train.jsonl --threads 1 --out runs/sim-validate

1. Calibrate a profile (`draftsmith.sim.calibrate`) on ``--calibration-prompts`` training prompts taken
   from the END of ``--data`` (the validation never decodes them).
2. Decode ``--prompts`` other training prompts with the real decoders, interleaved per prompt (plain,
   fixed-K chain, confidence stop, a built tree), then batched b=4 in groups of 4; record each
   configuration's step trace with its measured wall time (prefill included).
3. Replay every trace under the profile (`draftsmith.sim.steps.simulate_trace`) and report simulated
   vs measured tokens/s and the error per configuration.

Writes OUT/profile.yaml, OUT/traces/*.json and OUT/report.json (+ report.md).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from benchmarks.common import add_common_args, parser, provenance, setup, write_json
from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.engine.tree_build import parse_tree
from draftsmith.sim.calibrate import Calibrator
from draftsmith.sim.steps import from_batch_results, from_results, simulate_trace, target_identity
from draftsmith.train.training.predictors import load_drafter, training_prompts


# a coarser grid than the default, to keep the run short on a shared machine
ROWS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128, 256]
CONTEXTS = [0, 128, 384]


def build_parser():
    ap = parser("sim_validate", __doc__)
    ap.add_argument("drafter", help="drafter checkpoint directory")
    ap.add_argument("--data", required=True, help="training conversations (train.jsonl) for the prompts")
    ap.add_argument("--name", default="quickstart", help="the drafter's name in the profile")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--calibration-prompts", type=int, default=8)
    ap.add_argument("--calibration-ks", type=int, nargs="+", default=[1, 6], help="chain lengths calibrated")
    ap.add_argument("--calibration-tokens", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="fixed chain length")
    ap.add_argument("--confidence", type=float, default=0.4)
    ap.add_argument("--tree", default="built:4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batch-k", type=int, default=2)
    ap.add_argument("--hardware", default=None, help="hardware description for the profile")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                    help="what the profile is calibrated against (cpu: process CPU time, for a shared machine)")
    add_common_args(ap, threads=True, threads_default=1, seed=True, out="dir")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    bench = setup(a)
    target = bench.target
    drafter, ident = load_drafter(a.drafter, target)
    drafter.name = a.name
    bench.apply_layout(drafter)
    room = target.context_length - a.max_new_tokens - 16
    n_all = a.prompts + a.calibration_prompts + 50
    ids, _ = training_prompts(Path(a.data), target.tokenizer, n_all, min(room, 240))
    if len(ids) < a.prompts + a.calibration_prompts:
        raise SystemExit(f"{a.data}: only {len(ids)} usable prompts")
    val, cal = ids[: a.prompts], ids[-a.calibration_prompts:]
    tree = parse_tree(a.tree, a.drafter)
    depth = getattr(tree, "depth", None)
    hw = a.hardware or f"{platform.processor() or platform.machine()}, {a.threads} thread(s)"
    calib = Calibrator(target, name="cpu-here", hardware=hw, drafter=drafter, drafter_name=a.name, tree=tree,
                       tree_depth=depth, command="python -m benchmarks.sim_validate", clock=a.clock,
                       ks=tuple(a.calibration_ks), batch_sizes=(a.batch,), batch_k=a.batch_k,
                       max_new_tokens=a.calibration_tokens, rows=ROWS, contexts=CONTEXTS)
    tid = target_identity(target)
    decs = {"plain": (SpeculativeDecoder(target), dict(mode="plain", drafter=None)),
            f"chain K={a.k}": (SpeculativeDecoder(target, drafter, policy=FixedLength(a.k)),
                               dict(mode="chain", drafter=a.name, max_len=a.k)),
            f"confidence {a.confidence} (cap 8)": (
                SpeculativeDecoder(target, drafter, policy=ConfidenceStop(a.confidence, 8)),
                dict(mode="chain", drafter=a.name, probes_next=True, max_len=8)),
            f"tree {a.tree}": (SpeculativeDecoder(target, drafter, tree=tree),
                               dict(mode="tree", drafter=a.name, tree_depth=depth))}
    results = {k: [] for k in decs}
    cpu = {k: [] for k in decs}
    bcpu = []
    bname = f"batched b={a.batch} K={a.batch_k}"
    bdec = BatchedSpeculativeDecoder(target, drafter, k=a.batch_k)
    bres = []
    for name, (d, _) in decs.items():  # warm-up
        d.generate(val[0], 4)
    bdec.generate([val[0]], 4)
    # calibration rounds (on other prompts) interleaved with the validation runs: both see the same load
    for i, p in enumerate(val):
        calib.round(cal, i)
        for name, (d, _) in decs.items():
            t0 = time.process_time()
            results[name].append(d.generate(p, a.max_new_tokens, seed=a.seed + i))
            cpu[name].append(time.process_time() - t0)
        if (i + 1) % a.batch == 0:
            g = i + 1 - a.batch
            t0 = time.process_time()
            bres.append(bdec.generate(val[g:g + a.batch], a.max_new_tokens, seed=a.seed + g))
            bcpu.append(time.process_time() - t0)
        print(f"round {i + 1}/{len(val)}: calibration + every configuration", flush=True)
    prof, cal_report = calib.fit()
    prof.save(bench.out / "profile.yaml")
    print(prof.to_yaml())
    traces = {name: from_results(results[name], target_id=tid, **kw) for name, (_, kw) in decs.items()}
    traces[bname] = from_batch_results(bres, target_id=tid, drafter=a.name)
    for name, secs in [*cpu.items(), (bname, bcpu)]:
        for run, c in zip(traces[name].runs, secs):
            run.cpu_s = c
    rows = []
    for name, tr in traces.items():
        tr.save(bench.out / "traces" / (name.replace(" ", "_").replace("=", "").replace("(", "").replace(")", "")
                                        + ".json"))
        r = simulate_trace(tr, prof)
        r["config"] = name
        rows.append(r)
        print(f"{name}: wall {r['measured_tokens_per_s']:.2f} tok/s, cpu {r['measured_cpu_tokens_per_s']:.2f} "
              f"tok/s, simulated {r['simulated_tokens_per_s']:.2f} tok/s, error vs cpu {100 * r['error_cpu']:+.1f}%, "
              f"vs wall {100 * r['error']:+.1f}%", flush=True)
    md = ["| configuration | tokens | measured tok/s (CPU time) | simulated tok/s | error | measured tok/s (wall) "
          "| error vs wall |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['config']} | {r['tokens']} | {r['measured_cpu_tokens_per_s']:.2f} "
           f"| {r['simulated_tokens_per_s']:.2f} | {100 * r['error_cpu']:+.1f}% | {r['measured_tokens_per_s']:.2f} "
           f"| {100 * r['error']:+.1f}% |"
           for r in rows]
    report = {"hardware": hw, "prompts": len(val), "calibration_prompts": len(cal),
              "max_new_tokens": a.max_new_tokens, "calibration": cal_report, "rows": rows, **provenance()}
    write_json(bench.out / "report.json", report)
    (bench.out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return report


if __name__ == "__main__":
    main()
