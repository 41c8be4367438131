"""Drafting-length policies: when to stop drafting a chain.

A policy sees only draft-side information (the draft's logits and
distribution for the candidate next token, how many tokens are already
drafted, optional drafter features), so any policy keeps the decoder
lossless (docs/methods.md section 6). Learned predictors (SpecDec++, DISCO) plug in
by implementing `LengthPolicy`.

Optional policy methods (looked up once; a policy without them costs nothing):
  * ``reset()``: called by the decoder at the start of every generation (online
    policies such as Hugging Face's ROC refit start over, as HF does per ``generate``);
  * ``stop_after(signal, token) -> bool``: called after the token drawn from
    ``signal`` joined the chain; True ends the chain there (the token is still
    verified). This is "submit the candidate whose logits are already paid for,
    then stop" (SpecDec++'s one-token lag, HF's confidence criterion);
  * ``observe(state, tree, verdict, logits)``: called after verification with the
    target's logits at the root and every drafted node (acceptance traces, online refits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class DraftSignal:
    """What a policy may look at before the next draft token is drawn."""

    depth: int  # draft tokens already on the chain this step
    logits: torch.Tensor  # the drafter's logits for the candidate next token [V]
    q: torch.Tensor | None = None  # the exact distribution it will be drawn from (sampling mode)
    features: Any = None  # drafter-specific features (e.g. its last hidden state), if any
    _probs: torch.Tensor | None = field(default=None, repr=False)

    @property
    def probs(self) -> torch.Tensor:
        """The draft's confidence: q when sampling, softmax(logits) when greedy."""
        if self.q is not None:
            return self.q
        if self._probs is None:
            self._probs = torch.softmax(self.logits.float(), dim=-1)
        return self._probs


class LengthPolicy(Protocol):
    """Decides, before each draft token, whether to draft it."""

    max_len: int  # never draft more than this many tokens per step

    def should_continue(self, signal: DraftSignal) -> bool: ...


@dataclass(frozen=True)
class FixedLength:
    """Always draft ``k`` tokens (fewer only near max_new_tokens)."""

    k: int = 4

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"draft length must be >= 1, got {self.k}")

    @property
    def max_len(self) -> int:
        return self.k

    def should_continue(self, signal: DraftSignal) -> bool:
        return signal.depth < self.k


@dataclass(frozen=True)
class ConfidenceStop:
    """Stop when the draft's top-1 probability for the next token falls below ``threshold``.

    Kangaroo's second early exit (0.6 in its public code) and the Hugging Face
    assistant heuristic (0.4). Costs one host sync per draft token.
    """

    threshold: float = 0.6
    k: int = 6

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0 or self.k < 1:
            raise ValueError(f"need 0 <= threshold <= 1 and k >= 1, got {self.threshold}, {self.k}")

    @property
    def max_len(self) -> int:
        return self.k

    def should_continue(self, signal: DraftSignal) -> bool:
        return signal.depth < self.k and float(signal.probs.max()) >= self.threshold
