"""Losses shared by drafter trainers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hard_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels != -100 (0 if there are none)."""
    valid = labels != -100
    if not valid.any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits[valid], labels[valid])


def soft_ce(logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of -sum_x p_teacher(x) log q(x) (forward KL up to a constant)."""
    if not valid.any():
        return logits.sum() * 0.0
    logq = F.log_softmax(logits[valid].float(), dim=-1)
    p = F.softmax(teacher_logits[valid].float(), dim=-1)
    return -(p * logq).sum(-1).mean()


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
