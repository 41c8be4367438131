"""Medusa heads (arXiv 2401.10774), docs/methods.md section 2.

Head k (k = 1..K) reads the target's last hidden state h_t (after the final
norm) and predicts the token at t+k+1 (the target's own LM head predicts
t+1). Head k = ResBlock^n (zero-initialised) then a projection d -> V.

The projection is either the target's LM head, shared and frozen (default:
one weight read serves every head and the target's own next-token logits,
which is what makes heads cheap on a memory-bound CPU), or a trainable copy
initialised from it (the paper's Medusa-1 setup; ``share_lm_head: false``).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.common import ResBlock, copy_of_linear
from draftsmith.common.vocab import PrunedVocab
from draftsmith.heads.decode import HeadDrafter
from draftsmith.heads.objective import HeadObjective
from draftsmith.registry import KindBase, register


@register
class MedusaHeads(PrunedVocab, KindBase, nn.Module):
    kind = "medusa"
    builds_trees = True

    def __init__(self, hidden_size: int, vocab_size: int, lm_head: nn.Module, num_heads: int = 4,
                 num_layers: int = 1, share_lm_head: bool = True, vocab_keep: int | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"num_heads must be >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        if vocab_keep is not None and not share_lm_head:
            raise ValueError("vocab_keep prunes the shared LM head; it needs share_lm_head: true")
        self.config = {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_heads": num_heads,
                       "num_layers": num_layers, "share_lm_head": share_lm_head, "vocab_keep": vocab_keep}
        self.num_heads = num_heads
        # A list comprehension builds distinct modules: [ResBlock(d)] * n would share one.
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))
        if share_lm_head:
            self.lm_head = lm_head
            self.lm_head.requires_grad_(False)
            self.shared_with_target = ("lm_head",)
            self.proj = None
        else:
            self.lm_head = None
            self.shared_with_target = ()
            self.proj = nn.ModuleList(copy_of_linear(lm_head) for _ in range(num_heads))
        # the kept rows of the LM head (heads/vocab.py); ids are set from the training data before training
        self.init_pruned_vocab(lm_head, vocab_keep)

    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        return ["final"]

    @classmethod
    def from_config(cls, config: dict, target) -> "MedusaHeads":
        if int(config["hidden_size"]) != target.hidden_size or int(config["vocab_size"]) != target.vocab_size:
            raise ValueError("Medusa config does not match the target's hidden or vocabulary size")
        return cls(lm_head=target.lm_head, **config)

    @classmethod
    def make_objective(cls, recipe, cache, target, exclude: set[int]) -> HeadObjective:
        t = recipe.train
        return HeadObjective(cache, target, recipe.drafter.num_heads, loss=t.loss, soft_weight=t.soft_weight,
                             head_decay=t.head_decay, chunk_len=t.chunk_len, exclude=exclude)

    def eval_objective(self, cache, target=None) -> HeadObjective:
        """The objective that feeds whole sequences to these heads (held-out accuracy, tree building)."""
        return HeadObjective(cache, target, self.num_heads, chunk_len=1 << 30)

    def decoder_drafter(self, target, target_fingerprint: str | None = None, name: str = "medusa") -> HeadDrafter:
        return HeadDrafter(self, target_fingerprint=target_fingerprint, name=name)

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [K, ..., d]: each head's state before its projection."""
        return torch.stack([blk(hidden) for blk in self.blocks], dim=0)

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """[K, ..., d] -> [K, ..., V] logits ([K, ..., N] over the kept ids with a pruned vocabulary)."""
        if self.draft_head is not None:
            return self.draft_head(states)
        if self.proj is None:
            return self.lm_head(states)  # one matmul, one read of the weight
        return torch.stack([p(s) for p, s in zip(self.proj, states)], dim=0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every head: [..., d] -> [K, ..., V] (N when pruned); head k predicts t+k+1."""
        return self.project(self.head_states(hidden))
