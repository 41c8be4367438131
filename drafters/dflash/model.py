"""The DFlash drafter module: the target's fused context states -> decoder layers over a block -> draft logits.

Architecture (z-lab's reference and the trainers that follow it; docs/methods.md section 18):
  * ``fc``: Linear(n x H -> H, no bias) over the concatenated target states of `target_layers` (Hugging Face
    ``hidden_states`` indices), then ``hidden_norm``: the context c_j of every committed position j;
  * ``draft_layers`` decoder layers (Qwen3-style: RMS norms on each head's queries and keys, no biases). A block
    is the newest token t_a at position a followed by ``block_size - 1`` mask tokens at a+1..; its queries, keys
    and values come from the block's states (``input_norm`` first); each layer also projects the context through
    its own ``k`` (with ``k_norm``) and ``v``, without a norm of its own, and the block attends, non-causally, to
    the context of every position before a and to the whole block;
  * ``norm`` and the target's head (a `PrunedHead` over the draft vocabulary when ``vocab_keep`` is set); slot k
    (k >= 1) of the block gives the draft distribution of token t_{a+k};
  * the target's token embedding (the block's tokens and the mask token), frozen and shared (not stored).

The context stops before the block's first token: when decoding, that token is the one the target has just
produced, whose own states it has not computed yet. Training (`train_forward`: every anchor's block of a sequence
in one forward, each block seeing its own context) and decoding (`decode.DFlashDrafter`) call the same
`block` function, so they compute the same thing (a test checks it).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.common.hidden_cache import HiddenCache, decoder_of
from draftsmith.common.layers import DecoderLayer, RMSNorm, target_rope
from draftsmith.common.vocab import PrunedVocab
from draftsmith.drafters.dflash.config import DFlashModelConfig, default_target_layers
from draftsmith.drafters.dflash.decode import DFlashDrafter
from draftsmith.drafters.dflash.fast import FastDFlash
from draftsmith.drafters.dflash.objective import DFlashObjective, heldout_metrics, rank_acceptance
from draftsmith.engine.policies import FixedLength
from draftsmith.registry import KindBase, register
from draftsmith.schema import DecoderShape


def resolve_mask_token_id(tokenizer, vocab_size: int) -> tuple[int, str]:
    """The mask token when the recipe names none, in the reference trainers' order: the tokenizer's mask token, a
    spare embedding row past the tokenizer, then pad, eos, unk. Returns (id, where it came from)."""
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id), "the tokenizer's mask token"
        if len(tokenizer) < vocab_size:
            return len(tokenizer), "the first embedding row past the tokenizer's tokens"
        for what in ("pad", "eos", "unk"):
            i = getattr(tokenizer, f"{what}_token_id", None)
            if i is not None:
                return int(i), f"the tokenizer's {what} token"
    raise ValueError("DFlash needs a mask token: the tokenizer has no mask, pad, eos or unk token and no spare "
                     "embedding row; set drafter.mask_token_id to an id that never occurs in the data")


def check_target_layers(ids: list[int], num_layers: int) -> None:
    if not ids or not all(1 <= i < num_layers for i in ids) or sorted(set(ids)) != list(ids):
        raise ValueError(f"target_layers {ids} do not fit a target with {num_layers} layers: increasing indices in "
                         f"[1, {num_layers - 1}] are needed (the usual choice for it, which a recipe gets by leaving "
                         f"target_layers out: {default_target_layers(num_layers)})")


@register
class DFlashModule(PrunedVocab, KindBase, nn.Module):
    kind = "dflash"
    conditional_accuracy = True  # slot k's figures are over the blocks whose slots 1..k-1 drafted right
    builds_trees = True  # from its slots' acceptance by rank (`rank_acceptance`): a depth's nodes share one slot

    config_class = DFlashModelConfig

    def __init__(self, config: DFlashModelConfig, lm_head: nn.Module, embed: nn.Module, rotary: nn.Module):
        super().__init__()
        c = config
        check_target_layers(list(c.target_layers), c.num_layers)
        if c.mask_token_id is None or not 0 <= c.mask_token_id < c.vocab_size:
            raise ValueError(f"mask_token_id {c.mask_token_id} is not a row of the target's embedding "
                             f"(vocabulary {c.vocab_size})")
        if c.draft_len is not None and c.draft_len > c.block_size - 1:
            raise ValueError(f"draft_len {c.draft_len} is more than a block of {c.block_size} drafts "
                             f"({c.block_size - 1})")
        self.config = c
        self.target_layers, self.block_size = list(c.target_layers), c.block_size
        H, eps = c.hidden_size, c.eps
        self.fc = nn.Linear(len(self.target_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        inv_freq, rope_scale = target_rope(rotary)
        self.layers = nn.ModuleList(
            DecoderLayer(H, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, eps, qk_norm=True,
                         inv_freq=inv_freq, rope_scale=rope_scale) for _ in range(c.draft_layers))
        self.norm = RMSNorm(H, eps)
        self.lm_head, self.embed = lm_head, embed  # the target's, frozen and not stored
        self.shared_with_target = ("lm_head", "embed")
        self.init_pruned_vocab(lm_head, c.vocab_keep)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        if config.get("target_layers") is None:
            raise ValueError("DFlash's target_layers are derived from the target's layer count: fill the recipe's "
                             "drafter section for the target first (`with_target`)")
        return [f"layer:{int(i)}" for i in config["target_layers"]] + ["final"]

    @classmethod
    def for_target(cls, target, **fields) -> "DFlashModule":
        """A fresh drafter for ``target`` from a recipe's fields: random layers and ``fc``, the target's embedding
        and head rows; the target-derived fields (layers, mask token) filled in."""
        if fields.get("target_layers") is None:
            fields = {**fields, "target_layers": default_target_layers(int(target.model.config.num_hidden_layers))}
        if fields.get("mask_token_id") is None:
            fields = {**fields, "mask_token_id": resolve_mask_token_id(getattr(target, "tokenizer", None),
                                                                       target.vocab_size)[0]}
        config = cls.read_config({**DecoderShape.of(target), **fields})
        m = cls(config, target.lm_head, target.model.get_input_embeddings(), decoder_of(target.model).rotary_emb)
        return m.to(device=next(target.model.parameters()).device)

    @classmethod
    def from_config(cls, config, target) -> "DFlashModule":
        config = cls.read_config(config)
        config.check_layers(target, "DFlash")
        return cls(config, target.lm_head, target.model.get_input_embeddings(), decoder_of(target.model).rotary_emb)

    @classmethod
    def make_objective(cls, recipe, cache: HiddenCache, target, exclude: set[int]) -> DFlashObjective:
        d, t = recipe.drafter, recipe.train
        mask = d.mask_token_id
        if mask is None:  # as `for_target` resolves it for the module
            mask = resolve_mask_token_id(getattr(target, "tokenizer", None), target.vocab_size)[0]
        return DFlashObjective(cache, target, d.target_layers, d.block_size, gamma=d.gamma,
                               max_anchors=d.max_anchors, loss=t.loss, chunk_len=t.chunk_len, exclude=exclude,
                               seed=recipe.seed, mask_token_id=mask)

    def engine_gap(self, engine: str) -> str | None:
        """llama.cpp's converter drops d2t / t2d, so a pruned draft vocabulary would draft draft-vocabulary ids as
        target ids there; vLLM maps them."""
        if engine == "llama.cpp" and self.draft_head is not None:
            return "a pruned draft vocabulary (llama.cpp's DFlash reads no d2t; train with vocab_keep: null)"
        return None

    def heldout_metrics(self, cache: HiddenCache, target) -> dict:
        return heldout_metrics(self, cache, target)

    def rank_acceptance(self, cache: HiddenCache, target, sequences=None, ranks: int = 10) -> dict:
        """Per slot, acceptance by draft rank on the accepted path: what the trees stage builds trees from."""
        return rank_acceptance(self, cache, target, sequences=sequences, ranks=ranks)

    def decoder_drafter(self, target, target_fingerprint: str | None = None, name: str = "dflash") -> DFlashDrafter:
        return DFlashDrafter(target, self, target_fingerprint=target_fingerprint, name=name,
                             policy=FixedLength(self.config.draft_len or self.block_size - 1))

    def fast_drafting(self, compile: bool = True, int8: bool | None = None,
                      dtype: torch.dtype | None = None) -> FastDFlash:
        """Compiled drafting (drafters/dflash/fast.py), used by decoders whose target forward is compiled; ``int8``:
        weight-only int8 layers and head (default: on CPU in bf16/fp16, `int8_by_default`); ``dtype``: the dtype
        drafting computes in (default: the module's, bf16 for a float32 one on a CPU with native bf16,
        `drafting_dtype`)."""
        return FastDFlash(self, compile=compile, int8=int8, dtype=dtype)

    # ------------------------------------------------------------------ shared pieces
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target states [..., n x H] -> the context [..., H]: ``hidden_norm(fc(feats))``."""
        return self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context [..., C, H] at positions pos [C] -> per layer its keys and values [..., nkv, C, hd]."""
        return [layer.kv(ctx, pos) for layer in self.layers]

    def block(self, ids: torch.Tensor, pos: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
              mask: torch.Tensor | None) -> torch.Tensor:
        """Block tokens ids [..., Q] at positions pos [..., Q] over each layer's context keys and values (`context_kv`)
        -> output states [..., Q, H]; ``mask`` [..., Q, C + Q] (True: may attend), None: every key."""
        h = self.embed(ids).to(self.fc.weight.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx):
            q, k, v = layer.qkv(layer.attention_input(h), pos)
            h = layer.finish(h, layer.attend(q, torch.cat([ck, k], dim=-2), torch.cat([cv, v], dim=-2), mask))
        return h

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Output states [..., H] -> logits over the draft vocabulary [..., N] (V without pruning)."""
        return self.vocab_logits(self.norm(h))

    # ------------------------------------------------------------------ training: every block of a sequence at once
    def train_forward(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                      select: torch.Tensor | None = None) -> torch.Tensor:
        """feats [B, T, n x H] (the target states of positions 0..T-1), ids [B, A, S] (block j: the anchor token,
        then mask tokens), anchors [B, A] (block j's first position) -> draft logits [B, A, S, N], or with
        ``select`` (bool [B, A, S]) those of the selected slots only, [M, N]. Block j attends to the context of
        positions < anchors[j] and to its own S tokens, not to another block."""
        B, T, _ = feats.shape
        A, S = ids.shape[1], ids.shape[2]
        dev = feats.device
        ctx = self.context_kv(self.fuse(feats), torch.arange(T, device=dev))
        pos = (anchors[..., None] + torch.arange(S, device=dev)).reshape(B, A * S)
        before = torch.arange(T, device=dev)[None, None, :] < anchors.repeat_interleave(S, dim=1)[..., None]
        blk = torch.arange(A * S, device=dev) // S
        same = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
        mask = torch.cat([before, same], dim=-1)[:, None]  # [B, 1, A*S, T + A*S]
        h = self.block(ids.reshape(B, A * S), pos, ctx, mask).view(B, A, S, -1)
        return self.project(h if select is None else h[select])

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                select: torch.Tensor | None = None) -> torch.Tensor:
        """`train_forward` (one call through a possibly DDP-wrapped module)."""
        return self.train_forward(feats, ids, anchors, select)
