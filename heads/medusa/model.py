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
from draftsmith.heads.medusa.config import MedusaModelConfig
from draftsmith.heads.objective import HeadObjective
from draftsmith.registry import KindBase, register


@register
class MedusaHeads(PrunedVocab, KindBase, nn.Module):
    kind = "medusa"
    builds_trees = True

    config_class = MedusaModelConfig

    def __init__(self, config: MedusaModelConfig, lm_head: nn.Module):
        super().__init__()
        if config.vocab_keep is not None and not config.share_lm_head:
            raise ValueError("vocab_keep prunes the shared LM head; it needs share_lm_head: true")
        self.config = config
        hidden_size, num_heads, num_layers = config.hidden_size, config.num_heads, config.num_layers
        self.num_heads = num_heads
        # A list comprehension builds distinct modules: [ResBlock(d)] * n would share one.
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))
        if config.share_lm_head:
            self.lm_head = lm_head
            self.lm_head.requires_grad_(False)
            self.shared_with_target = ("lm_head",)
            self.proj = None
        else:
            self.lm_head = None
            self.shared_with_target = ()
            self.proj = nn.ModuleList(copy_of_linear(lm_head) for _ in range(num_heads))
        # the kept rows of the LM head (heads/vocab.py); ids are set from the training data before training
        self.init_pruned_vocab(lm_head, config.vocab_keep)

    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        return ["final"]

    @classmethod
    def from_config(cls, config, target) -> "MedusaHeads":
        config = cls.read_config(config)
        config.check_shape(target, "Medusa")
        return cls(config, target.lm_head)

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
