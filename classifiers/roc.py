"""Hugging Face's assistant confidence threshold with its online ROC refit, as a length policy.

Mirrors transformers 5.23 ``AssistedCandidateGenerator`` (generation/candidate_generator.py)
and ``ConfidenceCriteria`` (generation/stopping_criteria.py):
  * after each drafted token, its draft probability p (softmax of the assistant's
    processed scores: q when sampling, softmax of the logits when greedy) is recorded
    and drafting stops when p < threshold; the token is still verified;
  * after verification: ``matches += [1] * accepted``, one 0 if a draft was rejected,
    probabilities of drafts past the first rejection are dropped; once more than 5
    pairs hold both classes, the threshold is refit with sklearn's ``roc_curve``,
    minimising FPR + 3 * FNR (a rejected draft drafted costs 1, an accepted one
    stopped costs 3);
  * everything starts over at 0.4 on every generation (HF builds a new candidate
    generator per ``generate`` call).
HF's default cap is 20 assistant tokens; here ``max_len`` caps a round like every policy.
"""

from __future__ import annotations

import numpy as np

from draftsmith.engine.policies import DraftSignal


class RocRefitStop:
    """Confidence stop whose threshold HF refits online (see the module docstring)."""

    def __init__(self, threshold: float = 0.4, max_len: int = 8):
        if not 0.0 <= threshold <= 1.0 or max_len < 1:
            raise ValueError(f"need 0 <= threshold <= 1 and max_len >= 1, got {threshold}, {max_len}")
        self.initial, self.max_len = float(threshold), int(max_len)
        self.reset()

    def reset(self) -> None:
        self.threshold = self.initial
        self.probs: list[float] = []
        self.matches: list[int] = []
        self.refits = 0

    def should_continue(self, signal: DraftSignal) -> bool:
        return signal.depth < self.max_len

    def stop_after(self, signal: DraftSignal, token) -> bool:
        p = float(signal.probs[int(token)])
        self.probs.append(p)
        return p < self.threshold

    def observe(self, state, tree, verdict, logits) -> None:
        self.matches.extend([1] * verdict.accepted)
        if len(self.probs) > len(self.matches):
            self.matches.append(0)
        excess = len(self.probs) - len(self.matches)
        if excess > 0:
            del self.probs[-excess:]
        if len(self.probs) > 5 and {0, 1}.issubset(self.matches):
            from sklearn.metrics import roc_curve  # optional dependency, as in transformers

            fpr, tpr, thresholds = roc_curve(self.matches, self.probs)
            costs = fpr + 3 * (1 - tpr)
            self.threshold = float(thresholds[int(np.argmin(costs))])
            self.refits += 1
