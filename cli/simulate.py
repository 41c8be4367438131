"""``draftsmith simulate``: speculative decoding priced by a cost profile (draftsmith.sim).

  draftsmith simulate calibrate CKPT --data TRAIN.jsonl --out PROFILE.yaml   measure this machine
  draftsmith simulate record CKPT --data TRAIN.jsonl --mode chain --out T.json  a step trace of real runs
  draftsmith simulate run TRACE.json --profile P                             a step trace under a profile
  draftsmith simulate compare T1.json T2.json --plain P.json --profile P1 P2  speedups over plain, per profile
  draftsmith simulate replay TRACES_DIR --profile P [--drafter-cost NAME]    length policies on traces
  draftsmith simulate dsi [--heatmap PNG] [--point NAME:C:A]                 DSI vs SI vs plain

Every figure it prints is simulated; ``run`` also prints the measured one when the trace holds it.
Profiles: a YAML path or a built-in name (``draftsmith simulate profiles``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from draftsmith.checkpoint import command_line
from draftsmith.classifiers.traces import load_traces
from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.tree_build import parse_tree
from draftsmith.sim import dsi
from draftsmith.sim.batch import acceptance_by_depth, batch_table
from draftsmith.sim.calibrate import calibrate
from draftsmith.sim.profile import builtin_profiles, load_profile
from draftsmith.sim.replay import replay
from draftsmith.sim.steps import (check_trace_for, from_batch_results, from_results, load_step_trace, simulate_trace,
                                  target_identity)
from draftsmith.target import DEFAULT_TARGET, load_target
from draftsmith.train.training.predictors import load_drafter, training_prompts


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary, description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = sp.add_subparsers(dest="sim_command", required=True)

    c = sub.add_parser("calibrate", help="measure a cost profile on this machine")
    c.add_argument("drafter", nargs="?", default=None, help="drafter checkpoint (none: plain decoding only)")
    c.add_argument("--data", required=True, help="training conversations (train.jsonl): calibration prompts")
    c.add_argument("--name", default=None, help="the drafter's name in the profile (default: its kind)")
    c.add_argument("--target", default=None, help="target (default: the checkpoint's, else the default target)")
    c.add_argument("--prompts", type=int, default=8)
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--tree", default=None, help="also calibrate a tree, e.g. built:4")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time (a machine shared with other work; one thread only)")
    c.add_argument("--profile-name", default="this-machine")
    c.add_argument("--hardware", default=None)
    c.add_argument("--out", required=True, help="profile YAML to write")
    c.set_defaults(func=run_calibrate)

    r = sub.add_parser("record", help="decode training prompts and write a step trace")
    r.add_argument("drafter", nargs="?", default=None, help="drafter checkpoint (none: plain decoding)")
    r.add_argument("--data", required=True, help="training conversations (train.jsonl)")
    r.add_argument("--mode", choices=["plain", "chain", "tree", "batched"], default="chain")
    r.add_argument("--k", type=int, default=4, help="chain length (chain, batched)")
    r.add_argument("--tree", default="built:4")
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--name", default=None)
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    r.set_defaults(func=run_record)

    s = sub.add_parser("run", help="replay a step trace under a profile")
    s.add_argument("trace", help="step trace JSON (draftsmith simulate record, benchmarks.sim_validate)")
    s.add_argument("--profile", required=True, help="profile YAML or built-in name")
    s.add_argument("--drafter-cost", default=None, help="the profile's drafter entry to price drafting with "
                   "(default: the trace's drafter name)")
    s.set_defaults(func=run_trace)

    m = sub.add_parser("compare", help="step traces of several drafters under several profiles: speedups over plain")
    m.add_argument("traces", nargs="+", help="step traces of drafters (draftsmith simulate record)")
    m.add_argument("--plain", required=True, help="a step trace of plain decoding on the same prompts (--mode plain)")
    m.add_argument("--profile", required=True, nargs="+", help="profiles (YAML or built-in names)")
    m.add_argument("--out", default=None, help="JSON report")
    m.set_defaults(func=run_compare)

    p = sub.add_parser("replay", help="length policies on acceptance traces (draftsmith traces) under a profile")
    p.add_argument("traces", help="trace directory written by `draftsmith traces`")
    p.add_argument("--profile", required=True, nargs="+", help="one or more profiles (YAML or built-in names)")
    p.add_argument("--drafter-cost", default=None, help="the profiles' drafter entry (default: the only one)")
    p.add_argument("--max-len", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-predictors", action="store_true", help="skip DISCO and SpecDec++ (no training)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes for the batch-aware policy's plan")
    p.add_argument("--out", default=None, help="JSON report")
    p.set_defaults(func=run_replay)

    d = sub.add_parser("dsi", help="DSI vs SI vs plain decoding (offline model, time units)")
    d.add_argument("--point", action="append", default=[], metavar="NAME:C:A",
                   help="a setting to tabulate: drafter cost ratio c and acceptance rate a (repeatable)")
    d.add_argument("--servers", type=int, default=7, help="target instances DSI may use (speculation parallelism)")
    d.add_argument("--max-lookahead", type=int, default=20)
    d.add_argument("--tokens", type=int, default=1000, help="S, tokens per simulated sequence")
    d.add_argument("--repeats", type=int, default=5)
    d.add_argument("--heatmap", default=None, help="write the heat map PNG here")
    d.add_argument("--ndim", type=int, default=20, help="heat-map grid: (ndim + 1)^2 cells")
    d.add_argument("--out", default=None, help="JSON report")
    d.set_defaults(func=run_dsi)

    sub.add_parser("profiles", help="list the built-in profiles").set_defaults(func=run_profiles)
    sp.set_defaults(func=lambda a: sp.error("choose a simulate command"))


# ---------------------------------------------------------------------------- commands
def _setup(args, drafter_spec):
    """(target, drafter or None, drafter name) with the CPU decoding layout; prompts come from --data."""
    torch.set_num_threads(args.threads)
    target = load_target(getattr(args, "target", None) or DEFAULT_TARGET)
    drafter = name = None
    if drafter_spec:
        drafter, ident = load_drafter(drafter_spec, target)
        name = args.name or ident["name"]
        drafter.name = name
    apply_cpu_layout(target, *([drafter] if drafter is not None else []))
    return target, drafter, name


def _prompts(args, target, n):
    ids, skipped = training_prompts(Path(args.data), target.tokenizer, n, min(240, target.context_length - 200))
    if len(ids) < n:
        print(f"note: {len(ids)} usable prompts of {n} asked ({skipped})")
    return ids


def run_calibrate(args) -> int:
    target, drafter, name = _setup(args, args.drafter)
    ids = _prompts(args, target, args.prompts)
    tree = parse_tree(args.tree, args.drafter) if args.tree and drafter is not None else None
    hw = args.hardware or f"{platform.processor() or platform.machine()}, {args.threads} thread(s)"
    prof, report = calibrate(target, ids, name=args.profile_name, hardware=hw, drafter=drafter, drafter_name=name,
                             tree=tree, tree_depth=getattr(tree, "depth", None), max_new_tokens=args.max_new_tokens,
                             command=command_line(), clock=args.clock, log=print)
    prof.save(args.out)
    print(json.dumps(report, indent=2))
    print(f"profile {prof.name} -> {args.out}")
    return 0


def run_record(args) -> int:
    if args.mode != "plain" and not args.drafter:
        raise SystemExit(f"--mode {args.mode} needs a drafter checkpoint")
    target, drafter, name = _setup(args, args.drafter if args.mode != "plain" else None)
    ids = _prompts(args, target, args.prompts)
    tid = target_identity(target)
    meta = {"mode": args.mode, "prompts": len(ids), "max_new_tokens": args.max_new_tokens, "source": args.data}
    if args.mode == "batched":
        dec = BatchedSpeculativeDecoder(target, drafter, k=args.k)
        dec.generate([ids[0]], 4)
        res, cpu = [], []
        for i in range(0, len(ids) - args.batch + 1, args.batch):
            t0 = time.process_time()
            res.append(dec.generate(ids[i:i + args.batch], args.max_new_tokens, seed=i))
            cpu.append(time.process_time() - t0)
        tr = from_batch_results(res, target_id=tid, drafter=name, meta=meta)
    else:
        tree = parse_tree(args.tree, args.drafter) if args.mode == "tree" else None
        dec = (SpeculativeDecoder(target) if args.mode == "plain" else
               SpeculativeDecoder(target, drafter, tree=tree) if tree is not None else
               SpeculativeDecoder(target, drafter, policy=FixedLength(args.k)))
        dec.generate(ids[0], 4)
        res, cpu = [], []
        for i, p in enumerate(ids):
            t0 = time.process_time()
            res.append(dec.generate(p, args.max_new_tokens, seed=i))
            cpu.append(time.process_time() - t0)
        tr = from_results(res, mode=args.mode, target_id=tid, drafter=name, max_len=args.k,
                          tree_depth=getattr(tree, "depth", None), meta=meta)
    for run, c in zip(tr.runs, cpu):
        run.cpu_s = c if args.threads == 1 else None
    tr.save(args.out)
    print(f"step trace: {len(tr.runs)} runs, {tr.tokens} tokens -> {args.out}")
    return 0


def run_trace(args) -> int:
    tr = load_step_trace(args.trace)
    prof = load_profile(args.profile)
    check_trace_for(tr, prof.target, f"step trace {args.trace}")
    if not prof.target.get("fingerprint") and prof.target.get("name") != tr.target.get("name"):
        print(f"note: profile {prof.name} prices target {prof.target.get('name')!r}; the trace's decisions come from "
              f"{tr.target.get('name')!r} (a what-if: its acceptance at the profile's costs)")
    r = simulate_trace(tr, prof, args.drafter_cost)
    print(f"{tr.mode} trace, {r['tokens']} tokens, {r['steps']} steps under profile {prof.name} ({prof.hardware}):")
    print(f"  simulated: {r['simulated_tokens_per_s']:.2f} tokens/s ({r['simulated_s']:.3f} s)")
    if "measured_tokens_per_s" in r:
        print(f"  measured (wall): {r['measured_tokens_per_s']:.2f} tokens/s, error {100 * r['error']:+.1f}%")
    if "measured_cpu_tokens_per_s" in r:
        print(f"  measured (CPU time): {r['measured_cpu_tokens_per_s']:.2f} tokens/s, "
              f"error {100 * r['error_cpu']:+.1f}%")
    return 0


def drafter_entry(prof, trace) -> tuple[str, str]:
    """The profile's drafter cost for a trace: its drafter's own entry, else the profile's only one (a published
    profile's generic head), with a note saying which; an error naming the entries otherwise."""
    if trace.drafter in prof.drafters:
        return trace.drafter, ""
    if len(prof.drafters) == 1:
        only = next(iter(prof.drafters))
        return only, f"{trace.drafter} priced as {prof.name}'s {only!r}"
    raise ValueError(f"profile {prof.name} has no cost for drafter {trace.drafter!r} (it has "
                     f"{sorted(prof.drafters) or 'none'}): calibrate it, or record the trace with --name ENTRY")


def run_compare(args) -> int:
    plain = load_step_trace(args.plain)
    if plain.mode != "plain":
        raise ValueError(f"--plain {args.plain} is a {plain.mode!r} trace; record one with --mode plain")
    traces = [(t, load_step_trace(t)) for t in args.traces]
    profiles = [load_profile(p) for p in args.profile]
    out: dict = {"plain": args.plain, "profiles": {p.name: {"hardware": p.hardware, "source": p.source}
                                                  for p in profiles}, "rows": []}
    print("SIMULATED: each drafter's recorded steps (acceptance, shapes) priced by each profile, against plain "
          "decoding's recorded steps under the same profile")
    print("| drafter | mode | tau | " + " | ".join(f"{p.name}: tok/s, x plain, tau to break even" for p in profiles)
          + " |")
    print("|---|---|---|" + "---|" * len(profiles))
    notes = set()
    for path, tr in traces:
        check_trace_for(tr, plain.target, f"step trace {path}")
        steps = sum(len(r.steps) for r in tr.runs)
        row = {"trace": path, "drafter": tr.drafter, "mode": tr.mode, "tau": tr.tokens / max(1, steps),
               "profiles": {}}
        cells = []
        for prof in profiles:
            check_trace_for(tr, prof.target, f"step trace {path}")
            who, note = drafter_entry(prof, tr)
            if note:
                notes.add(note)
            r = simulate_trace(tr, prof, who)
            base = simulate_trace(plain, prof)
            x = r["simulated_tokens_per_s"] / base["simulated_tokens_per_s"]
            # the tau at which this drafter's steps (as recorded, priced here) would match plain decoding
            even = (r["simulated_s"] / max(1, r["steps"])) / (base["simulated_s"] / max(1, base["tokens"]))
            row["profiles"][prof.name] = {"drafter_cost": who, "tokens_per_s": r["simulated_tokens_per_s"],
                                          "plain_tokens_per_s": base["simulated_tokens_per_s"], "speedup": x,
                                          "break_even_tau": even}
            cells.append(f"{r['simulated_tokens_per_s']:.1f}, {x:.2f}x, {even:.2f}")
        out["rows"].append(row)
        print(f"| {tr.drafter} | {tr.mode} | {row['tau']:.2f} | " + " | ".join(cells) + " |")
    for prof in profiles:
        print(f"plain under {prof.name}: {simulate_trace(plain, prof)['simulated_tokens_per_s']:.1f} tok/s "
              f"({prof.hardware})")
    for n in sorted(notes):
        print(f"note: {n}")
    out["notes"] = sorted(notes)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


def run_replay(args) -> int:
    meta = load_traces(args.traces, "calibration").meta
    out = {"traces": args.traces, "drafter": meta.get("drafter"), "target": meta.get("target"), "profiles": {}}
    for spec in args.profile:
        prof = load_profile(spec)
        fp = prof.target.get("fingerprint")
        if fp and fp != meta["target"]["fingerprint"]:
            raise SystemExit(f"profile {prof.name} was measured on target {prof.target.get('name')} (fingerprint "
                             f"{fp}), the traces on {meta['target']['name']} ({meta['target']['fingerprint']})")
        who = args.drafter_cost or (next(iter(prof.drafters)) if len(prof.drafters) == 1 else None)
        if who is None:
            raise SystemExit(f"profile {prof.name} holds {sorted(prof.drafters)}: name one with --drafter-cost")
        cost = prof.relative_cost(who, args.max_len)
        res = replay(args.traces, cost, max_len=args.max_len, temperature=args.temperature,
                     predictors=not args.no_predictors)
        out["profiles"][prof.name] = {"hardware": prof.hardware, "drafter_cost": who, **res}
        print(f"== SIMULATED under profile {prof.name} ({prof.hardware}); drafter pass = "
              f"{cost['draft_per_forward']:.3f} x a 1-row forward; verify 8 drafts = {cost['verify'][-1]:.2f}x")
        print("| policy | tokens per 1-row-forward time | tau | mean draft len | vs best fixed K |")
        print("|---|---|---|---|---|")
        for k, v in res["policies"].items():
            print(f"| {k} | {v['tokens_per_cost']:.3f} | {v['tau']:.2f} | {v['mean_draft_len']:.2f} | "
                  f"{100 * v['vs_best_fixed']:+.1f}% |")
        cal = load_traces(args.traces, "calibration").at_temperature(args.temperature)
        acc = acceptance_by_depth(cal.columns["position"], cal.columns["ratio"].astype(float), res["max_len"])
        sizes = [b for b in args.batch_sizes if b * (res["max_len"] + 1) <= prof.forward.rows[-1]]
        tab = batch_table(prof, who, acc, sizes, range(1, res["max_len"] + 1))
        plan = {b: tab.best_k(b) for b in sizes}
        gain = {b: tab.goodput(b, plan[b]) / tab.goodput(b, 0) for b in sizes}
        out["profiles"][prof.name]["batch_aware"] = {"acceptance_by_depth": acc, "k_by_batch": plan,
                                                     "goodput_over_plain": gain, "table": tab.to_dict()}
        print("batch-aware K by batch size (SIMULATED): " + ", ".join(
            f"b={b}: K={plan[b]} ({gain[b]:.2f}x plain)" for b in sizes))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    return 0


def _point(spec: str) -> tuple[str, float, float]:
    try:
        name, c, a = spec.rsplit(":", 2)
        return name, float(c), float(a)
    except ValueError:
        raise SystemExit(f"--point {spec!r}: expected NAME:C:A, e.g. hydra:0.08:0.4") from None


def run_dsi(args) -> int:
    ks = range(1, args.max_lookahead + 1)
    kw = dict(ks=ks, servers=args.servers, S=args.tokens, repeats=args.repeats)
    out: dict = {"servers": args.servers, "lookaheads": [1, args.max_lookahead], "S": args.tokens,
                 "repeats": args.repeats, "points": []}
    if args.point:
        print("| setting | c | a | SI / plain | DSI / plain | DSI / SI | DSI / best of SI, plain | k SI | k DSI |")
        print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.point:
        name, c, a = _point(spec)
        r = dsi.speedups(c, a, **kw)
        r["name"] = name
        out["points"].append(r)
        print(f"| {name} | {c:.3f} | {a:.3f} | {r['si_over_plain']:.2f}x | {r['dsi_over_plain']:.2f}x | "
              f"{r['dsi_over_si']:.2f}x | {r['dsi_over_best']:.2f}x | {r['k_si']} | {r['k_dsi']} |")
    if args.heatmap:
        from draftsmith.sim.plot import heatmap  # optional dependency (matplotlib), only for the picture

        cs, accs = dsi.heatmap_axes(args.ndim)
        cells = dsi.grid(cs, accs, **kw)
        heatmap(cells, out["points"], args.heatmap, servers=args.servers)
        si_slower = sum(c["si_over_plain"] < 1 for c in cells)
        worst = min(c["dsi_over_best"] for c in cells)
        out["grid"] = {"cells": len(cells), "si_slower_than_plain": si_slower,
                       "dsi_over_best_min": worst, "dsi_over_si_range": [min(c["dsi_over_si"] for c in cells),
                                                                         max(c["dsi_over_si"] for c in cells)],
                       "dsi_strictly_faster_than_both": sum(c["dsi_over_best"] > 1 + 1e-9 for c in cells)}
        out["cells"] = cells
        g = out["grid"]
        slower = [c for c in cells if c["dsi_over_best"] < 1 - 1e-9]
        g["dsi_slower_than_best"] = [{k: c[k] for k in ("c", "a", "dsi_over_best", "k_si", "k_dsi")} for c in slower]
        print(f"grid of {g['cells']} cells (c x a), lookahead 1..{args.max_lookahead}, {args.servers} target "
              f"instances: SI slower than plain in {si_slower}; DSI faster than both SI and plain in "
              f"{g['dsi_strictly_faster_than_both']}, as fast as the better in "
              f"{g['cells'] - g['dsi_strictly_faster_than_both'] - len(slower)}, slower in {len(slower)} (worst "
              f"{worst:.3f}x, at c = {sorted({c['c'] for c in slower})}); DSI / SI from "
              f"{g['dsi_over_si_range'][0]:.2f}x to {g['dsi_over_si_range'][1]:.2f}x -> {args.heatmap}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


def run_profiles(args) -> int:
    for name, path in builtin_profiles().items():
        p = load_profile(path)
        print(f"{name}: {p.hardware} -- {p.source[:100]}")
    return 0
