"""Hydra and Hydra++ heads (arXiv 2402.05109), docs/methods.md sections 3 and 10.

Sequentially dependent heads: head i (i = 1..K) at position t reads the base
state b_t and the input embeddings of tokens t+1..t+i, and predicts token
t+i+1 (teacher-forced in training; the drafted path in decoding). Its
distillation teacher is the target's distribution at t+i.

  * base state b_t: the target's last hidden state h_t (after the final norm),
    or, with ``prefix_layer``, the output at t of one extra decoder layer run
    causally over h_0..h_t (Hydra++'s prefix layer);
  * head i: an input layer ``b + Dropout(SiLU(W [b; e_{t+1}; ...; e_{t+i}]))``
    with W zero-initialised (the head starts as the target's own next-token
    prediction), then ``num_layers - 1`` residual blocks, then the target's
    frozen LM head (shared, like Medusa's default);
  * Hydra++ = ``prefix_layer: true, num_layers: 4, dropout: 0.2`` trained with
    the soft loss and equal head weights (recipes/hydra-pp.yaml).

The token embeddings are the target's own input embeddings, frozen and not
saved (``shared_with_target``). Every stacked layer is its own module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from draftsmith.common.layers import DecoderLayer, rename_on_load, rope_frequencies, rope_parameters
from draftsmith.common.vocab import PrunedVocab
from draftsmith.heads.decode import HeadDrafter
from draftsmith.heads.common import ResBlock
from draftsmith.heads.hydra.config import HydraModelConfig, PrefixShape
from draftsmith.heads.hydra.fast import FastHydra
from draftsmith.heads.objective import HydraObjective
from draftsmith.registry import KindBase, register
from torch import nn


class PrefixLayer(DecoderLayer):
    """Hydra++'s prefix layer: the shared `DecoderLayer` (pre-norm, causal self-attention with RoPE, SwiGLU MLP)
    over base hidden states, one sequence at a time.

    Its KV cache is a pair of tensors that ``forward`` returns instead of mutating, so a copied decode state never
    shares it. Output projections start at zero: the layer starts as the identity.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 rope_theta: float = 10000.0, eps: float = 1e-6, **traits):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps,
                         inv_freq=rope_frequencies(head_dim, rope_theta), zero_outputs=True, **traits)

    def forward(self, x: torch.Tensor, pos: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [T, d] at positions ``pos`` [T] after the ``past`` entries -> (out [T, d], (keys, values))."""
        T = x.shape[0]
        q, k, v = self.qkv(self.attention_input(x), pos)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        S = k.shape[1]
        # Row j (absolute S - T + j) sees keys 0 .. S - T + j.
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        return self.finish(x, self.attend(q, k, v, mask)), (k, v)


class HydraHead(nn.Module):
    """Head i: b + Dropout(SiLU(W [b; e_1..e_i])), then ``num_layers - 1`` residual blocks."""

    def __init__(self, hidden_size: int, index: int, num_layers: int, dropout: float):
        super().__init__()
        self.index = index
        self.inp = nn.Linear(hidden_size * (index + 1), hidden_size)
        nn.init.zeros_(self.inp.weight)
        nn.init.zeros_(self.inp.bias)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.blocks = nn.Sequential(*[ResBlock(hidden_size, dropout) for _ in range(num_layers - 1)])

    def forward(self, base: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """base [P, d], emb [P, i, d] (embeddings of tokens t+1..t+i) -> [P, d]."""
        x = torch.cat([base, emb.flatten(1)], dim=-1)
        return self.blocks(base + self.drop(F.silu(self.inp(x))))


@register
class HydraHeads(PrunedVocab, KindBase, nn.Module):
    kind = "hydra"
    builds_trees = True
    conditional_accuracy = True  # each head reads the drafts before it

    config_class = HydraModelConfig

    def __init__(self, config: HydraModelConfig, lm_head: nn.Module, embed: nn.Module):
        super().__init__()
        if config.prefix_layer and config.prefix is None:
            raise ValueError("prefix_layer needs the layer's shape (prefix: heads, kv_heads, head_dim, ...)")
        if not config.prefix_layer and config.prefix is not None:
            config = config.model_copy(update={"prefix": None})
        self.config = config
        hidden_size, num_heads, num_layers, dropout = (config.hidden_size, config.num_heads, config.num_layers,
                                                       config.dropout)
        self.num_heads = num_heads
        self.heads = nn.ModuleList(HydraHead(hidden_size, i, num_layers, dropout) for i in range(1, num_heads + 1))
        self.prefix = PrefixLayer(hidden_size, **config.prefix.model_dump()) if config.prefix_layer else None
        rename_on_load(self, {"prefix.norm1.": "prefix.input_norm.", "prefix.norm2.": "prefix.post_norm."})
        self.lm_head = lm_head.requires_grad_(False)
        self.embed = embed.requires_grad_(False)
        self.shared_with_target = ("lm_head", "embed")
        # the kept rows of the LM head (heads/vocab.py); ids are set from the training data before training
        self.init_pruned_vocab(lm_head, config.vocab_keep)

    @property
    def out_head(self) -> nn.Module:
        """The projection drafts go through: the pruned head, or the target's LM head."""
        return self.draft_head if self.draft_head is not None else self.lm_head

    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        return ["final"]

    @staticmethod
    def prefix_shape(target) -> dict:
        c = target.config
        theta = rope_parameters(c)["rope_theta"]  # the full-attention layers' where each layer type has its own
        nh = int(c.num_attention_heads)
        return {"num_heads": nh, "num_kv_heads": int(getattr(c, "num_key_value_heads", None) or nh),
                "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // nh),
                "intermediate_size": int(c.intermediate_size), "rope_theta": float(theta),
                "eps": float(getattr(c, "rms_norm_eps", 1e-6)), **PrefixShape.traits(target)}

    @classmethod
    def for_target(cls, target, **fields) -> "HydraHeads":
        """New heads for ``target`` from a recipe's fields; a prefix layer starts from the target's last decoder
        layer."""
        config = cls.read_config({"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, **fields})
        if config.prefix_layer:
            config = config.model_copy(update={"prefix": PrefixShape(**cls.prefix_shape(target))})
        m = cls(config, target.lm_head, target.model.get_input_embeddings())
        if config.prefix_layer:
            m.prefix.init_from(target.model.get_decoder().layers[-1])
        return m

    @classmethod
    def from_config(cls, config, target) -> "HydraHeads":
        config = cls.read_config(config)
        config.check_shape(target, "Hydra")
        return cls(config, target.lm_head, target.model.get_input_embeddings())

    @classmethod
    def make_objective(cls, recipe, cache, target, exclude: set[int]) -> HydraObjective:
        t = recipe.train
        return HydraObjective(cache, target, recipe.drafter.num_heads, prefix_layer=recipe.drafter.prefix_layer,
                              loss=t.loss, soft_weight=t.soft_weight, head_decay=t.head_decay,
                              chunk_len=t.chunk_len, exclude=exclude)

    def eval_objective(self, cache, target=None) -> HydraObjective:
        """The objective that feeds whole sequences to these heads (held-out accuracy, tree building)."""
        return HydraObjective(cache, target, self.num_heads, chunk_len=1 << 30, prefix_layer=self.prefix is not None)

    def decoder_drafter(self, target, target_fingerprint: str | None = None, name: str = "hydra") -> HeadDrafter:
        return HeadDrafter(self, target_fingerprint=target_fingerprint, name=name)

    def fast_drafting(self, compile: bool = True, int8: bool | None = None, dtype: torch.dtype | None = None):
        """Compiled drafting (heads/hydra/fast.py), used by decoders whose target forward is compiled; ``int8``:
        weight-only int8 heads (default: on CPU in bf16/fp16, `int8_by_default`); ``dtype``: the dtype drafting
        computes in (default: the heads', bf16 for float32 heads on a CPU with native bf16, `drafting_dtype`)."""
        return FastHydra(self, compile=compile, int8=int8, dtype=dtype)

    # ------------------------------------------------------------------ base states
    def base_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, d] hidden states of one sequence from position 0 -> [T, d] base states."""
        if self.prefix is None:
            return hidden
        return self.prefix(hidden, torch.arange(hidden.shape[0], device=hidden.device))[0]

    def base_step(self, rows: torch.Tensor, start: int, past):
        """Incremental base states for rows at positions start.. (decoding) -> (base [n, d], new past)."""
        if self.prefix is None:
            return rows, None
        return self.prefix(rows, torch.arange(start, start + rows.shape[0], device=rows.device), past)

    # ------------------------------------------------------------------ heads
    def head_states(self, base: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """base [P, d], next_tokens [P, >=K] (tokens t+1..t+K) -> [K, P, d] teacher-forced head states."""
        emb = self.embed(next_tokens[:, : self.num_heads]).to(base.dtype)
        return torch.stack([h(base, emb[:, : h.index]) for h in self.heads], dim=0)

    def forward(self, hidden: torch.Tensor | None, next_tokens: torch.Tensor, seqs: list | None = None) -> torch.Tensor:
        """Teacher-forced logits [K, P, V] ([K, P, N] with a pruned vocabulary); head i predicts token t+i+1.

        ``hidden`` [P, d] are the base states; with a prefix layer pass
        ``seqs`` instead: (h_0..h_{hi-1} of a sequence, lo, kept-rows mask)
        per window, and the base states are computed here.
        """
        if seqs is not None:
            hidden = torch.cat([self.base_states(h)[lo: lo + len(keep)][keep] for h, lo, keep in seqs])
        elif self.prefix is not None:
            raise ValueError("Hydra heads with a prefix layer need whole sequences (seqs), not bare states")
        return self.out_head(self.head_states(hidden, next_tokens))

    def draft_states(self, base: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """base [1, d]; paths [n, i] (root then drafted tokens, i <= K) -> head i's states [n, d]."""
        i = min(paths.shape[1], self.num_heads)
        emb = self.embed(paths[:, :i]).to(base.dtype)
        return self.heads[i - 1](base.expand(paths.shape[0], -1), emb)
