"""Held-out accuracy of head drafters, and the chain acceptance it predicts."""

from __future__ import annotations

import torch

from draftsmith.common.vocab import draft_head
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.common.losses import predicted_chain_tau


@torch.no_grad()
def head_accuracy(model, cache: HiddenCache, num_heads: int, ks=(1, 5), batch_positions: int = 512,
                  ranks: int = 0, sequences=None) -> dict:
    """Per-head top-k accuracy over every labelled position of a cache (or of ``sequences`` in it).

    With ``ranks`` > 0 also returns ``rank_acc[k][i]``: how often the i-th
    ranked token of head k is the label (used to build trees). Hydra heads
    are teacher-forced: their figures are acceptance given the path so far.
    """
    model.eval()
    obj = model.eval_objective(cache)  # the head kind knows how to feed itself a window
    dev = next(model.parameters()).device
    dh = draft_head(model)  # pruned vocabulary: ranks are draft ids; a pruned label is always a miss
    count = torch.zeros(num_heads)
    kmax = max(max(ks), ranks)
    rank_hits = torch.zeros(num_heads, kmax)
    for i in (range(len(cache)) if sequences is None else sorted(sequences)):
        n = len(cache.tokens(i))
        for lo in range(0, n, batch_positions):
            b = obj.window(i, lo, min(n, lo + batch_positions))
            if b is None:
                continue
            b = b.to(dev)
            logits = obj.logits(model, b)  # [K, P, V]
            lab = b.labels if dh is None else dh.labels(b.labels)[1]
            top = logits.topk(min(kmax, logits.shape[-1]), dim=-1).indices  # [K, P, kmax]
            eq = (top == lab.unsqueeze(-1)).cpu()
            if eq.shape[-1] < kmax:  # fewer kept ids than ranks asked for: the rest never hit
                eq = torch.cat([eq, eq.new_zeros(*eq.shape[:-1], kmax - eq.shape[-1])], -1)
            valid = (lab != -100).cpu()
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
