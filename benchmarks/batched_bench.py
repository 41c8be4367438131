"""Batched decoding throughput: batch sizes x {plain batched (ours), HF generate batched, speculative fixed K,
speculative batch-aware}, on MT-Bench first turns, one interleaved run.

    python -m benchmarks.batched_bench --checkpoint CKPT --batch-sizes 1 2 4 8 16 --prompts 16 \
        --max-new-tokens 128 --k 4 --out runs/batched

(``--drafter-layers N`` instead of ``--checkpoint``: the untrained first-N-layers model drafter.)

Steps: the batch-aware policy is calibrated first on this machine (`engine.batch_policy.calibrate`:
step cost per batch size and K, acceptance from the same runs), then for every batch size b the
prompts (sorted by length, so HF's left padding wastes little) are cut into groups of b, and every
group runs through every method in turn, in an order shuffled per group with a seeded generator
(interleaved, so machine noise and the position in the sequence hit all alike). Figures:
tokens/s (generated tokens, prefill included in the time), tau (tokens per row-forward, our methods;
HF has no drafts), speedups over plain batched (ours) and over HF at the same b, the K the policy chose,
and greedy rows identical to plain batched decoding (counted). Writes ``OUT/batched_bench.json``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import add_common_args, parser, provenance, setup, write_json
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.batched import (BatchAwareLength, BatchedSpeculativeDecoder, GoodputTable, calibrate,
                                       plain_batched_decoder)
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.metrics import tokens_per_second
from draftsmith.engine.sampling import SamplingParams

PLAIN, HF = "plain batched (ours)", "HF generate batched"


@torch.no_grad()
def hf_batched(target, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
               seed: int) -> tuple[list[list[int]], float]:
    """Hugging Face ``generate`` on one left-padded batch: (new tokens per row, cut after EOS; wall seconds)."""
    model, tok = target.model, target.tokenizer
    dev = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    w = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), w), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), w), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, w - len(p):] = torch.tensor(p)
        att[i, w - len(p):] = 1
    kw = {"eos_token_id": list(target.eos_token_ids), "pad_token_id": pad}
    if sampling.greedy:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kw.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    eos = set(target.eos_token_ids)
    rows = []
    for r in out[:, w:].tolist():
        hit = next((i for i, t in enumerate(r) if t in eos), None)
        rows.append(r if hit is None else r[: hit + 1])
    return rows, wall


def run(a) -> dict:
    bench = setup(a, drafters=lambda t: drafter_from_checkpoint(a.checkpoint, t) if a.checkpoint
                  else first_layers_drafter(t, a.drafter_layers))
    target, drafter, layout, out = bench.target, bench.drafters, bench.layout, bench.out
    sampling = SamplingParams(a.temperature, a.top_k if a.temperature > 0 else 0, a.top_p if a.temperature > 0 else 1.0)
    prompts = sorted(bench.prompts(a.prompts), key=lambda p: len(p.ids))
    ids = [p.ids for p in prompts]
    sizes = sorted(set(a.batch_sizes))
    if a.passes < 1:
        raise SystemExit(f"--passes must be >= 1, got {a.passes}")
    if max(sizes) > len(ids):
        raise SystemExit(f"--prompts {len(ids)} is fewer than the largest batch size {max(sizes)}")

    def make(k: int) -> BatchedSpeculativeDecoder:
        return BatchedSpeculativeDecoder(target, drafter if k else None, k=max(k, 1), sampling=sampling)

    t0 = time.perf_counter()
    if a.policy_table:
        table = GoodputTable.load(a.policy_table)
    else:
        table = calibrate(make, ids, sizes, a.calib_ks, new_tokens=a.calib_tokens, repeats=a.calib_repeats,
                          log=print if a.verbose else None)
    calib_s = time.perf_counter() - t0
    table.save(out / "goodput_table.json")  # now, so a stopped run can be redone with --policy-table
    policy = BatchAwareLength(table, margin=a.margin)
    print(f"calibration {calib_s:.0f} s; acceptance by depth {[round(x, 3) for x in table.acceptance]}; "
          f"K by batch size {policy.plan(sizes)}", flush=True)
    ours = {PLAIN: plain_batched_decoder(target, sampling), f"spec K={a.k}": make(a.k),
            "spec batch-aware": BatchedSpeculativeDecoder(target, drafter, k=policy, sampling=sampling)}
    names = [PLAIN, HF, f"spec K={a.k}", "spec batch-aware"]
    figures: dict = {}
    for b in sizes:
        groups = [ids[i:i + b] for i in range(0, len(ids) - b + 1, b)]  # whole groups only: every b sees b rows
        acc = {n: {"tokens": 0, "wall_s": 0.0, "row_forwards": 0, "k": [], "rows": []} for n in names}
        for n, dec in ours.items():  # warm-up at this batch size (allocation, first calls)
            dec.generate(groups[0], 4)
        hf_batched(target, groups[0], 4, sampling, a.seed)
        order = random.Random(a.seed)
        for g, grp in enumerate(groups * a.passes):
            for n in order.sample(names, len(names)):
                if n == HF:
                    rows, wall = hf_batched(target, grp, a.max_new_tokens, sampling, a.seed + g)
                    acc[n]["tokens"] += sum(len(r) for r in rows)
                    acc[n]["wall_s"] += wall
                    acc[n]["rows"] += rows
                    continue
                res = ours[n].generate(grp, a.max_new_tokens, seed=a.seed + 1000 * g)
                acc[n]["tokens"] += res.tokens
                acc[n]["wall_s"] += res.wall_s
                acc[n]["row_forwards"] += res.row_forwards
                acc[n]["k"] += [s.k for s in res.steps]
                acc[n]["rows"] += [r.tokens for r in res.rows]
            print(f"b={b} group {g + 1}/{len(groups) * a.passes}: " + ", ".join(
                f"{n} {acc[n]['tokens'] / acc[n]['wall_s']:.1f} tok/s" for n in names), flush=True)
        row = {}
        for n in names:
            x = acc[n]
            tps = tokens_per_second(x["tokens"], x["wall_s"])
            row[n] = {"tokens": x["tokens"], "wall_s": x["wall_s"], "tokens_per_s": tps,
                      "tau": x["tokens"] / x["row_forwards"] if x["row_forwards"] else None}
            if x["k"]:
                row[n]["k_steps"] = {str(k): x["k"].count(k) for k in sorted(set(x["k"]))}
            if sampling.greedy and n != PLAIN:
                same = sum(r == p for r, p in zip(x["rows"], acc[PLAIN]["rows"]))
                row[n]["rows_identical_to_plain"] = f"{same}/{len(x['rows'])}"
        for n in names:
            for base in (PLAIN, HF):
                bt = row[base]["tokens_per_s"]
                row[n][f"speedup_vs_{'plain' if base == PLAIN else 'hf'}"] = row[n]["tokens_per_s"] / bt if bt else 0.0
        row["policy_k"] = policy.choose(b)
        figures[str(b)] = row
    print(table_text(figures, names))
    report = {"figures": figures, "calibration": table.to_dict(), "calibration_s": calib_s,
              "config": {k: v for k, v in vars(a).items()}, "cpu_layout": layout, "target": target.name,
              "drafter": getattr(drafter, "name", type(drafter).__name__), **provenance()}
    path = write_json(out / "batched_bench.json", report, indent=1)
    table.save(out / "goodput_table.json")
    print(f"wrote {path} and goodput_table.json")
    return report


def table_text(figures: dict, names: list[str]) -> str:
    lines = ["| batch | method | tok/s | tau | vs plain (ours) | vs HF | K steps | greedy rows = plain |",
             "|---|---|---|---|---|---|---|---|"]
    for b, row in figures.items():
        for n in names:
            x = row[n]
            tau = f"{x['tau']:.2f}" if x.get("tau") else "-"
            ks = ", ".join(f"K={k}: {c}" for k, c in x.get("k_steps", {}).items()) if n != PLAIN else "-"
            lines.append(f"| {b} | {n} | {x['tokens_per_s']:.1f} | {tau} | {x['speedup_vs_plain']:.2f}x | "
                         f"{x['speedup_vs_hf']:.2f}x | {ks or '-'} | {x.get('rows_identical_to_plain', '-')} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = parser("batched_bench", __doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a trained drafter checkpoint directory (its target is loaded by --target)")
    src.add_argument("--drafter-layers", type=int, help="the untrained first-N-layers model drafter instead")
    add_common_args(ap, threads=True, device=True, seed=True, cpu_layout=True, out="dir")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns (spread over categories)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft length of the fixed-K method")
    ap.add_argument("--calib-ks", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="K values calibrated")
    ap.add_argument("--calib-tokens", type=int, default=16, help="new tokens per calibration run")
    ap.add_argument("--calib-repeats", type=int, default=2)
    ap.add_argument("--passes", type=int, default=1,
                    help="run every group this many times (more samples per cell; one group at b = prompts)")
    ap.add_argument("--margin", type=float, default=0.05,
                    help="the batch-aware policy speculates only where its measured goodput beats plain "
                         "by more than this share")
    ap.add_argument("--policy-table", default=None, help="a goodput_table.json to reuse instead of calibrating")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--verbose", action="store_true", help="print every calibration cell")
    return ap


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    if a.k < 1:
        raise SystemExit("--k must be >= 1")
    return run(a)


if __name__ == "__main__":
    main()
