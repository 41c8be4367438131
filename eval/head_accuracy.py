"""Held-out accuracy of head drafters, and the chain acceptance it predicts."""

from __future__ import annotations

import torch

from draftsmith.heads.objective import head_labels
from draftsmith.train.cache import HiddenCache


def predicted_chain_tau(top1: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: tokens per step a greedy chain of these heads predicts.

    Treats head k's accuracy as the chance of acceptance given heads 1..k-1
    were accepted (an approximation: heads are measured independently).
    """
    tau, run = 1.0, 1.0
    for a in top1:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def head_accuracy(model, cache: HiddenCache, num_heads: int, ks=(1, 5), batch_positions: int = 2048,
                  ranks: int = 0) -> dict:
    """Per-head top-k accuracy over every labelled position of a cache.

    With ``ranks`` > 0 also returns ``rank_acc[k][i]``: how often the i-th
    ranked token of head k is the label (used to build Medusa trees).
    """
    model.eval()
    count = torch.zeros(num_heads)
    kmax = max(max(ks), ranks)
    rank_hits = torch.zeros(num_heads, kmax)
    for i in range(len(cache)):
        tok, m = cache.tokens(i), cache.mask(i)
        n = len(tok)
        for lo in range(0, n, batch_positions):
            hi = min(n, lo + batch_positions)
            lab = torch.from_numpy(head_labels(tok, m, lo, hi, num_heads))
            keep = (lab != -100).any(0)
            if not keep.any():
                continue
            h = cache.states(i, "final", lo, hi)[keep]
            lab = lab[:, keep]
            logits = model(h)  # [K, P, V]
            top = logits.topk(kmax, dim=-1).indices  # [K, P, kmax]
            eq = top == lab.unsqueeze(-1)
            valid = lab != -100
            for k in range(num_heads):
                v = valid[k]
                count[k] += v.sum()
                rank_hits[k] += eq[k][v].float().sum(0)
    cum = rank_hits.cumsum(-1)
    out = {"positions": count.tolist()}
    for kk in ks:
        out[f"top{kk}"] = [float(cum[k, kk - 1] / count[k]) if count[k] else 0.0 for k in range(num_heads)]
    out["predicted_chain_tau"] = predicted_chain_tau(out["top1"])
    if ranks:
        out["rank_acc"] = [[float(rank_hits[k, r] / count[k]) if count[k] else 0.0 for r in range(ranks)]
                           for k in range(num_heads)]
    return out
