"""Distillation divergences between the target's distribution p and the drafter's q (docs/methods.md section 7).

Every function takes student logits and teacher logits over the same ids
([P, V'] each; with a pruned vocabulary V' = the kept ids, so the teacher is
renormalised over them by its softmax) and returns the mean over rows:

  * ``fkl``: forward KL(p || q) = sum p (log p - log q) (soft cross-entropy
    up to the teacher's entropy; mode-covering);
  * ``rkl``: reverse KL(q || p) = sum q (log q - log p) (mode-seeking);
  * ``tvd``: total variation 0.5 sum |p - q| = 1 - sum min(p, q), i.e. one
    minus the per-token acceptance alpha (DistillSpec's TVD);
  * ``jsd``: DistillSpec's JSD[beta] = beta KL(p || m) + (1 - beta) KL(q || m),
    m = beta p + (1 - beta) q (0 < beta < 1; beta = 0.5 is the usual JSD).

The teacher is detached: only the drafter learns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DIVERGENCES = ("fkl", "rkl", "tvd", "jsd")


def _kl_from_logs(loga: torch.Tensor, logb: torch.Tensor) -> torch.Tensor:
    """Per row KL(a || b) = sum a (log a - log b), with 0 log 0 = 0."""
    a = loga.exp()
    return torch.where(a > 0, a * (loga - logb), torch.zeros_like(a)).sum(-1)


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "fkl",
               beta: float = 0.5) -> torch.Tensor:
    """Mean over rows of the divergence ``kind`` between p = softmax(teacher) and q = softmax(student)."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must cover the same ids")
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0
    logq = F.log_softmax(student_logits.float(), dim=-1)
    logp = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    if kind == "fkl":
        per = _kl_from_logs(logp, logq)
    elif kind == "rkl":
        per = _kl_from_logs(logq, logp)
    elif kind == "tvd":
        per = 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    else:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
        logm = torch.logaddexp(logp + torch.log(torch.tensor(beta)), logq + torch.log(torch.tensor(1.0 - beta)))
        per = beta * _kl_from_logs(logp, logm) + (1.0 - beta) * _kl_from_logs(logq, logm)
    return per.mean()
