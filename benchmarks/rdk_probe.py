"""Rebuild a pruned standalone drafter's RDK map with other constructions and measure each offline.

    python -m benchmarks.rdk_probe CKPT [CKPT ...] --data runs/standalone-data \\
        [--variant conditional:16:1.0 column:16:1.0 column:16:0.3 ...] --out runs/rdk-probe.json

A variant is WEIGHTS:TOPK:MAX_ROW_MASS (`build_rdk`). For every checkpoint and variant the map is built
from the data's training cache (the checkpoint's own weights and kept ids unchanged) and scored on the
held-out cache (the target's answers to MT-Bench first turns) with `heldout_metrics`: the drafter's
alpha with q' alone and with q_RDK, the mass q_RDK moves off the kept set, the target's mass there, and
the alpha of a perfectly distilled pruned drafter with and without the map (the construction's ceiling).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_common_args, parser, setup, write_json
from draftsmith.checkpoint import load_checkpoint
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.drafters.standalone.model import StandaloneObjective
from draftsmith.drafters.standalone.rdk import build_rdk

FIGURES = ("expected_acceptance", "expected_acceptance_rdk", "greedy_acceptance", "greedy_acceptance_rdk",
           "target_mass_off_kept", "rdk_mass_off_kept", "oracle_acceptance", "oracle_acceptance_rdk")


def parse_variant(text: str) -> tuple[str, int, float]:
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"variant {text!r} is not WEIGHTS:TOPK:MAX_ROW_MASS")
    return parts[0], int(parts[1]), float(parts[2])


@torch.no_grad()
def dense_probe(model, train: HiddenCache, held: HiddenCache, target, positions: int,
                lams=(0.1, 0.25, 0.5, 1.0), batch_rows: int = 512) -> dict:
    """The dense conditional-expectation map M* = C / C_i (every pair counted, [N, V] in memory) and its
    mixtures (1 - lam) I + lam M* (row-stochastic, so lossless): the drafter's alpha and the perfect pruned
    drafter's alpha under each. The reference any context-free affinity matrix of this kind is judged by."""
    kept = model.draft_head.kept_ids.cpu()
    V, N = target.vocab_size, len(kept)
    C = torch.zeros(N, V)
    c_i = torch.zeros(N, dtype=torch.float64)
    used = 0
    for i in range(len(train)):
        if used >= positions:
            break
        rows = np.nonzero(train.mask(i)[1:] > 0)[0][: positions - used]
        for s in range(0, len(rows), batch_rows):
            r = rows[s:s + batch_rows]
            h = train.states(i, "final", int(r[0]), int(r[-1]) + 1)[torch.from_numpy(r - r[0])]
            p = torch.softmax(teacher_logits(target, h), dim=-1)
            q = p[:, kept] / p[:, kept].sum(-1, keepdim=True)
            C += q.T @ p
            c_i += q.sum(0).double()
        used += len(rows)
    M = C / c_i.float().clamp_min(1e-30)[:, None]
    del C
    obj = StandaloneObjective(held, target, chunk_len=1 << 30)
    sums: dict[str, float] = {}
    n = 0
    model.eval()
    for s in range(0, len(obj.chunks), 8):
        b = obj.prepare(list(range(s, min(s + 8, len(obj.chunks)))))
        p = torch.softmax(b.teacher.float(), -1)
        for name, qk in (("drafter", torch.softmax(model(b.ids, b.attn, b.rows).float(), -1)),
                         ("oracle", p[:, kept] / p[:, kept].sum(-1, keepdim=True))):
            q_full = torch.zeros_like(p)
            q_full[:, kept] = qk
            moved = qk @ M
            for lam in lams:
                qr = (1 - lam) * q_full + lam * moved
                key = f"dense_{name}_lam{lam:g}"
                sums[key] = sums.get(key, 0.0) + float(torch.minimum(p, qr).sum())
        n += b.positions
    return {"positions_fit": used, "positions_heldout": n, **{k: v / max(n, 1) for k, v in sums.items()}}


def main(argv=None) -> None:
    ap = parser("rdk_probe", __doc__)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--data", required=True, help="a run directory holding cache/train and cache/heldout")
    add_common_args(ap, out="file")
    ap.add_argument("--variant", nargs="*", type=parse_variant,
                    default=[("conditional", 16, 1.0), ("column", 16, 1.0)])
    ap.add_argument("--positions", type=int, default=20000)
    ap.add_argument("--dense", action="store_true", help="also the dense conditional-expectation map M*")
    a = ap.parse_args(argv)
    target = setup(a, out_file=True).target
    train, held = (HiddenCache(Path(a.data) / "cache" / "train", target),
                   HiddenCache(Path(a.data) / "cache" / "heldout", target))
    rows = []
    for ck in a.checkpoints:
        model, _ = load_checkpoint(ck, target)
        if model.rdk is None:
            raise SystemExit(f"{ck}: not a pruned drafter with an RDK map")
        kept = model.draft_head.kept_ids.cpu()
        for weights, topk, cap in a.variant:
            t0 = time.perf_counter()
            parent, weight, info = build_rdk(train, target, kept, None, a.positions, topk, weights=weights,
                                             max_row_mass=cap)
            model.rdk.set(kept, parent, weight)
            built = time.perf_counter() - t0
            m = model.heldout_metrics(held, target)
            row = {"checkpoint": ck, "weights": weights, "topk": topk, "max_row_mass": cap, "build_s": round(built, 1),
                   "info": info, **{k: m[k] for k in FIGURES}}
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "info"}),
                  flush=True)
        if a.dense:
            t0 = time.perf_counter()
            d = dense_probe(model, train, held, target, a.positions)
            row = {"checkpoint": ck, "weights": "dense", "build_s": round(time.perf_counter() - t0, 1), **d}
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    write_json(a.out, rows, indent=1)


if __name__ == "__main__":
    main()
