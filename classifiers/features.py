"""Draft-side features of one draft candidate: one definition for traces, training and policies.

At depth k of a chain (k tokens already drafted this round) a length policy sees
the drafter's distribution for the candidate d_{k+1} (`DraftSignal.probs`: q when
sampling, softmax of the logits when greedy) and the drafter's state that
produced it (the state after consuming d_k; the root's state at k = 0). From
these, before the candidate is drawn:

  * ``position``: k + 1, the candidate's 1-based position in the round;
  * ``top1``, ``top2``: the two largest probabilities;
  * ``entropy``: of the distribution, in nats;
  * ``log_cum_prev``: log of the product of the probabilities of d_1..d_k
    (the cumulative draft probability of the prefix; 0 at k = 0).

The cumulative draft probability including the candidate (``cum_q``) and the
candidate's own probability (``q_token``) are known only after the draw; traces
record them too. DISCO reads `DISCO_FEATURES`; SpecDec++ reads the hidden state.
"""

from __future__ import annotations

import math

import torch

DISCO_FEATURES = ("top1", "top2", "entropy", "position", "log_cum_prev")
LOG_FLOOR = -50.0  # log of a zero probability, clipped so features stay finite


def distribution_features(probs: torch.Tensor) -> tuple[float, float, float]:
    """(top1, top2, entropy) of a [V] distribution, in one host transfer."""
    p = probs.float()
    top = torch.topk(p, 2).values
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum()
    t1, t2, e = torch.stack([top[0], top[1], ent]).tolist()
    return t1, t2, max(e, 0.0)


def safe_log(x: float) -> float:
    return math.log(x) if x > 0 else LOG_FLOOR


def last_row(features) -> torch.Tensor | None:
    """The drafter state that produced the candidate: the last row of `DraftSignal.features`."""
    if features is None or not isinstance(features, torch.Tensor):
        return None
    return features.reshape(-1, features.shape[-1])[-1]
