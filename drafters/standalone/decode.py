"""Decoding a standalone drafter: the engine's `ModelDrafter` with a target-space output head.

The drafter's own KV cache, tree attention and compaction are `ModelDrafter`'s.
Only the last product changes when the vocabulary is pruned:
  * pruned: hidden -> the kept rows of the head (N products, not V) -> the
    kept logits at the kept ids and the dtype's minimum everywhere else, so
    q is exactly 0 off the kept set and the decoder verifies with the q it
    drew from (lossless, heads/vocab.py);
  * RDK: the kept-set distribution q' is redistributed by the sparse
    affinity map, q_RDK = M^T q' (drafters/rdk.py), and handed over as
    log q_RDK: the decoder's softmax of it is q_RDK itself at temperature 1
    (at other temperatures, q_RDK^(1/T) renormalised), the same vector for
    drawing and verifying, so any fixed M is lossless.
The drafter still reads every target id (full embeddings): a drafted pruned
id (RDK) is fed back like any other token.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.engine import drafters as engine  # engine.project looked up per call (step_breakdown wraps it)
from draftsmith.engine.drafters import ModelDrafter
from draftsmith.engine.policies import LengthPolicy


class TargetSpaceHead(nn.Module):
    """Hidden states -> logits over every target id from a pruned head (and an optional RDK map)."""

    def __init__(self, draft_head: nn.Module, rdk: nn.Module | None = None):
        super().__init__()
        self.draft_head, self.rdk = draft_head, rdk

    @property
    def vocab_size(self) -> int:
        return int(self.draft_head.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kept = engine.project(self.draft_head, h)
        return self.draft_head.to_target(kept) if self.rdk is None else self.rdk.logits(kept)


class StandaloneModelDrafter(ModelDrafter):
    """`ModelDrafter` over a standalone drafter's model, with its pruned head / RDK map when it has them."""

    def __init__(self, model: nn.Module, *, draft_head: nn.Module | None = None, rdk: nn.Module | None = None,
                 target_fingerprint: str | None = None, name: str = "standalone", max_depth: int | None = None,
                 policy: LengthPolicy | None = None):
        super().__init__(model, target_fingerprint=target_fingerprint, name=name, max_depth=max_depth)
        if draft_head is not None:
            self.head = TargetSpaceHead(draft_head.eval(), None if rdk is None else rdk.eval())
        elif rdk is not None:
            raise ValueError("an RDK map needs a pruned head")
        if policy is not None:
            self.default_policy = policy

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size if isinstance(self.head, TargetSpaceHead) else int(self.head.weight.shape[0])
