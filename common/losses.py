"""Losses shared by drafter trainers, and the held-out figures they report."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hard_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels != -100 (0 if there are none)."""
    if not (labels != -100).any():
        return logits.sum() * 0.0
    # ignore_index instead of selecting the valid rows: the same mean, without copying the logits (and scattering
    # their gradient back) for a batch of rows x vocabulary
    return F.cross_entropy(logits, labels, ignore_index=-100)


def soft_ce(logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of -sum_x p_teacher(x) log q(x) (forward KL up to a constant).

    Where most rows are valid (the head kinds' batches), every row is computed and the invalid ones are masked
    out of the sum: selecting the valid rows would copy [rows, vocabulary] twice and scatter the gradient back
    (about 12% of a Hydra training step on a 2-core EPYC); where few are, they are selected."""
    n = int(valid.sum())
    if n == 0:
        return logits.sum() * 0.0
    if 2 * n < valid.numel():
        logits, teacher_logits, valid = logits[valid], teacher_logits[valid], None
    logq = F.log_softmax(logits.float(), dim=-1)
    p = F.softmax(teacher_logits.float(), dim=-1)
    per_row = -(p * logq).sum(-1)
    if valid is None:
        return per_row.mean()
    return torch.where(valid, per_row, per_row.new_zeros(())).sum() / n


@torch.no_grad()
def topk_hits(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> dict[int, tuple[int, int]]:
    """{k: (hits, count)} of labels inside each row's top-k, over labels != -100."""
    valid = labels != -100
    n = int(valid.sum())
    if n == 0:
        return {k: (0, 0) for k in ks}
    top = logits[valid].topk(min(max(ks), logits.shape[-1]), dim=-1).indices
    lab = labels[valid].unsqueeze(-1)
    return {k: (int((top[:, :k] == lab).any(-1).sum()), n) for k in ks}


def predicted_chain_tau(top1: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: tokens per step a greedy chain of these heads or steps predicts.

    Treats step k's accuracy as the chance of acceptance given steps 1..k-1 were accepted (exact where the
    accuracies are conditional on the earlier steps', an approximation where each is measured alone).
    """
    tau, run = 1.0, 1.0
    for a in top1:
        run *= a
        tau += run
    return tau


def add_hits(acc: dict[str, list[int]], hits: dict[str, tuple[int, int]]) -> None:
    """Add one batch's ``{key: (hits, count)}`` to the running ``acc``."""
    for key, (h, n) in hits.items():
        a = acc.setdefault(key, [0, 0])
        a[0] += h
        a[1] += n


def chain_metrics(acc: dict[str, list[int]], steps: int) -> dict:
    """Held-out figures of a drafter that drafts ``steps`` tokens in order, from accumulated ``stepK/top1`` (every
    position) and ``stepK/top1_cond`` (positions whose steps 1..K-1 drafted right) hits: each step's top-1, the
    conditional top-1 (step 1's is its top-1) and the chain's predicted acceptance length from them."""
    top1 = [acc[f"step{k}/top1"][0] / max(acc[f"step{k}/top1"][1], 1) for k in range(1, steps + 1)]
    cond = [top1[0]] + [acc[f"step{k}/top1_cond"][0] / max(acc[f"step{k}/top1_cond"][1], 1)
                        for k in range(2, steps + 1)]
    return {"step_top1": top1, "step_top1_conditional": cond, "predicted_chain_tau": predicted_chain_tau(cond),
            "positions": acc["step1/top1"][1]}
