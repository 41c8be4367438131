"""Kangaroo self-drafting (arXiv 2404.18911), docs/methods.md sections 4 and 10.

Draft path: the target's first l decoder layers (frozen, shared with the
target, never saved) -> an adapter -> the target's frozen LM head. The
adapter is the public one: ``x + Attn(RMSNorm(x))`` (full-size attention with
the target's head layout and RoPE, its own KV cache), then an RMSNorm; a
SwiGLU MLP after the attention only with ``adapter_mlp: true``.

Initialisation: q/k/v and the first norm are copied from the target's layer
l+1 (the layer that would read the same state), the output projection (and
the MLP's down projection) start at zero and the last norm is the target's
final norm, so a fresh adapter is exactly the untrained early exit (first l
layers + final norm + LM head) and training starts from that peer.

Training (`KangarooObjective`): soft cross-entropy at the SAME position t (no
shift) between the target's distribution from the cached final state h_t^L
(through the frozen LM head, detached) and the adapter's from the cached
layer-l state h_t^l, over positions whose next token is an assistant token.
The adapter attends over h_0^l..h_t^l of its sequence, as it does when
decoding. Logged: expected acceptance sum_x min(p, q).

Decoding lives in `draftsmith.drafters.kangaroo.decode` (`KangarooDrafter`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from draftsmith.common.chunks import make_chunks
from draftsmith.common.hidden_cache import HiddenCache, decoder_of, teacher_logits
from draftsmith.common.layers import DecoderLayer, LayerKV, RMSNorm, rename_on_load, target_rope
from draftsmith.common.losses import hard_ce, soft_ce, topk_hits
from draftsmith.common.vocab import PrunedVocab, draft_head
from draftsmith.drafters.kangaroo.config import KangarooModelConfig
from draftsmith.drafters.kangaroo.decode import KangarooDrafter, check_exit_layer, check_threshold
from draftsmith.registry import KindBase, register
from torch import nn


@register
class KangarooAdapter(PrunedVocab, KindBase, nn.Module):
    """The trainable part of a Kangaroo drafter: the adapter, reading the target's layer-l states."""

    kind = "kangaroo"

    config_class = KangarooModelConfig

    def __init__(self, config: KangarooModelConfig, lm_head: nn.Module, rotary: nn.Module):
        super().__init__()
        c = config
        check_exit_layer(c.exit_layer, c.num_layers)
        check_threshold(c.threshold)
        if c.vocab_keep is not None and not 1 <= int(c.vocab_keep) <= c.vocab_size:
            raise ValueError(f"vocab_keep {c.vocab_keep} must keep between 1 and the vocabulary's {c.vocab_size} ids")
        self.config = c
        self.exit_layer, self.threshold, self.max_draft_len = c.exit_layer, c.threshold, c.max_draft_len
        # the shared decoder layer (the MLP only with adapter_mlp), output projections at zero, with the target's
        # RoPE (frequencies and scaling copied into the layer's own buffer: casting the adapter leaves the
        # target's rotary alone)
        inv_freq, rope_scale = target_rope(rotary)
        self.layer = DecoderLayer(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.eps,
                                  mlp=c.adapter_mlp, inv_freq=inv_freq, rope_scale=rope_scale, zero_outputs=True,
                                  **c.layer_traits())
        self.norm_out = RMSNorm(c.hidden_size, c.eps, offset=c.norm_offset)  # the target's final norm
        # checkpoints written before the layer was the shared one hold its weights at the top level
        rename_on_load(self, {**{f"{n}.": f"layer.{n}." for n in ("q", "k", "v", "o", "gate", "up", "down")},
                              "norm1.": "layer.input_norm.", "norm_mlp.": "layer.post_norm."})
        self.lm_head = lm_head.requires_grad_(False)
        self.shared_with_target = ("lm_head",)
        # A pruned vocabulary (heads/vocab.py): the kept rows of the frozen head, the id map saved with them.
        self.init_pruned_vocab(lm_head, c.vocab_keep)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def cache_needs(config: dict) -> list[str]:
        return [f"layer:{int(config['exit_layer'])}", "final"]

    @classmethod
    def for_target(cls, target, **fields) -> "KangarooAdapter":
        """A fresh adapter for ``target`` from a recipe's fields, initialised from its layer l+1 and final norm
        (see the module doc)."""
        body = decoder_of(target.model)
        # the layer named against the target's count first (the config alone knows only l >= 1)
        check_exit_layer(int(fields.get("exit_layer", KangarooModelConfig.model_fields["exit_layer"].default)),
                         len(body.layers))
        config = cls.read_config({**KangarooModelConfig.of(target), **KangarooModelConfig.traits(target), **fields})
        m = cls(config, target.lm_head, body.rotary_emb)
        # decoder layer l+1 (0-based index l) reads h^l in the target: its input norm, q, k, v (and MLP norm, gate
        # and up with adapter_mlp)
        m.layer.init_from(body.layers[config.exit_layer])
        with torch.no_grad():
            m.norm_out.weight.copy_(body.norm.weight.float())
        return m

    @classmethod
    def from_config(cls, config, target) -> "KangarooAdapter":
        config = cls.read_config(config)
        config.check_layers(target, "Kangaroo")
        return cls(config, target.lm_head, decoder_of(target.model).rotary_emb)

    @staticmethod
    def make_objective(recipe, cache: HiddenCache, target, exclude: set[int] | None = None) -> "KangarooObjective":
        """The trainer's objective for this kind (the trainer never branches on kind names)."""
        t = recipe.train
        return KangarooObjective(cache, target, recipe.drafter.exit_layer, loss=t.loss, soft_weight=t.soft_weight,
                                 chunk_len=t.chunk_len, exclude=exclude)

    def heldout_metrics(self, cache: HiddenCache, target) -> dict:
        """`heldout_metrics` of this adapter on a cache (for a report stage)."""
        return heldout_metrics(self, cache, target)

    def decoder_drafter(self, target, target_fingerprint: str | None = None, name: str = "kangaroo") -> KangarooDrafter:
        """This adapter as a `draftsmith.engine.decoder` drafter (double early exit by default)."""
        return KangarooDrafter(target, self.exit_layer, adapter=self, target_fingerprint=target_fingerprint,
                               name=name, threshold=self.threshold, max_draft_len=self.max_draft_len)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Adapter states -> logits over the kept ids (pruned) or the full vocabulary."""
        return self.vocab_logits(h)

    # ------------------------------------------------------------------ math
    def adapt(self, x: torch.Tensor, pos: torch.Tensor,
              kv: LayerKV | None = None, start: int = 0,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """Layer-l states x [T, d] at positions ``pos`` -> adapter states [T, d] (after the last norm).

        Without ``kv`` the rows are one causal sequence. With ``kv`` (a `LayerKV`, keys and
        values [H_kv, capacity, D], pre-allocated) the rows' keys/values are
        written at slots [start, start + T) and row j attends to slots
        [0, start + j] (decoding; slot = position for chains), or to the slots
        ``mask`` [T, start + T] (bool, True = may attend) allows (tree nodes:
        the committed prefix, their ancestors and themselves).
        """
        T, lay = x.shape[0], self.layer
        q, k, v = lay.qkv(lay.attention_input(x), pos)
        if kv is not None:
            kv.keys[:, start:start + T] = k
            kv.values[:, start:start + T] = v
            k, v = kv.keys[:, :start + T], kv.values[:, :start + T]
        S = k.shape[1]
        if mask is None and T > 1:
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        return self.norm_out(lay.finish(x, lay.attend(q, k, v, mask)))

    def forward(self, seqs: list[tuple[torch.Tensor, int, torch.Tensor]]) -> torch.Tensor:
        """Logits [P, V] at the kept rows: per window (h^l_0..h^l_{hi-1} of a sequence, lo, kept-rows mask)."""
        out = [self.adapt(h, torch.arange(h.shape[0], device=h.device))[lo: lo + len(keep)][keep]
               for h, lo, keep in seqs]
        return self.project(torch.cat(out))


# ---------------------------------------------------------------------- training objective
@dataclass
class KangarooBatch:
    seqs: list  # per window: (layer-l states of positions 0..hi-1, lo, kept-rows mask over lo..hi-1)
    labels: torch.Tensor  # [P] token t+1 (an assistant token) of every kept position t
    teacher: torch.Tensor  # [P, V] the target's logits at t, from the cached final state

    @property
    def positions(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device) -> "KangarooBatch":
        return KangarooBatch([(h.to(device), lo, k.to(device)) for h, lo, k in self.seqs], self.labels.to(device),
                             self.teacher.to(device))


class KangarooObjective:
    """Windows of cached sequences; soft CE at the same position against the target's distribution.

    Position t is kept if token t+1 is an assistant token. ``loss``: "soft"
    (the paper's), "hard" (CE on token t+1) or "mix".
    """

    def __init__(self, cache: HiddenCache, target, exit_layer: int, loss: str = "soft", soft_weight: float = 0.5,
                 chunk_len: int = 128, exclude: set[int] | None = None):
        self.need = f"layer:{int(exit_layer)}"
        have = cache.index.get("needs", [])
        if self.need not in have or "final" not in have:
            raise ValueError(f"cache {cache.path} holds {have}; kangaroo with exit_layer {exit_layer} needs "
                             f"['{self.need}', 'final']: rebuild it (draftsmith cache RECIPE into a fresh output dir)")
        self.cache, self.target = cache, target
        self.loss_kind, self.soft_weight = loss, soft_weight
        self.chunks = make_chunks(cache, chunk_len, min_offset=1, exclude=exclude)
        if not self.chunks:
            raise ValueError("the cache holds no trainable positions (no assistant tokens); check the data stage")

    @torch.no_grad()
    def window(self, i: int, lo: int, hi: int) -> KangarooBatch | None:
        """Positions lo..hi-1 of sequence i whose next token is an assistant token (None if none is)."""
        tok, m = self.cache.tokens(i), self.cache.mask(i)
        n = len(tok)
        t = np.arange(lo, hi)
        keep = (t + 1 < n) & (m[np.minimum(t + 1, n - 1)] > 0)
        if not keep.any():
            return None
        keep_t = torch.from_numpy(keep)
        labels = torch.from_numpy(tok[t[keep] + 1].astype(np.int64))
        teacher = teacher_logits(self.target, self.cache.states(i, "final", lo, hi))[keep_t]
        return KangarooBatch([(self.cache.states(i, self.need, 0, hi), lo, keep_t)], labels, teacher)

    @torch.no_grad()
    def prepare(self, chunk_ids: list[int]) -> KangarooBatch:
        parts = [p for p in (self.window(*self.chunks[c]) for c in chunk_ids) if p is not None]
        return KangarooBatch([s for p in parts for s in p.seqs], torch.cat([p.labels for p in parts]),
                             torch.cat([p.teacher for p in parts]))

    def loss(self, model, batch: KangarooBatch) -> tuple[torch.Tensor, dict]:
        logits = model(batch.seqs)  # one call through the (possibly DDP-wrapped) module
        valid = torch.ones(batch.positions, dtype=torch.bool, device=logits.device)
        dh = draft_head(model)  # pruned: the teacher renormalised over the kept ids, pruned labels left out
        teacher = batch.teacher if dh is None else batch.teacher[:, dh.kept_ids]
        labels = batch.labels if dh is None else dh.labels(batch.labels)[0]
        if self.loss_kind == "soft":
            total = soft_ce(logits, teacher, valid)
        elif self.loss_kind == "hard":
            total = hard_ce(logits, labels)
        else:
            total = (1 - self.soft_weight) * hard_ce(logits, labels) + \
                self.soft_weight * soft_ce(logits, teacher, valid)
        return total, {"logits": logits.detach(), "draft_head": dh}

    @torch.no_grad()
    def stats(self, aux: dict, batch: KangarooBatch) -> dict:
        """Top-1/top-5 on token t+1, agreement with the teacher's argmax, expected acceptance sum_x min(p, q)."""
        lg = aux["logits"].float()
        dh = aux.get("draft_head")
        if dh is not None:  # in target-id space: q is 0 off the kept ids, a pruned label is a miss
            lg = dh.to_target(lg)
        hits = topk_hits(lg, batch.labels)
        agree = topk_hits(lg, batch.teacher.argmax(-1), ks=(1,))
        return {"head1/top1": hits[1], "head1/top5": hits[5], "teacher/top1": agree[1],
                "expected_acceptance": float(expected_acceptance(lg, batch.teacher).mean())}


def expected_acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per row sum_x min(p(x), q(x)) = 1 - TV(p, q): the chance a token drawn from q is accepted (T = 1)."""
    q = torch.softmax(draft_logits.float(), dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def heldout_metrics(model: KangarooAdapter, cache: HiddenCache, target, windows_per_batch: int = 16) -> dict:
    """Figures of an adapter over every labelled position of a cache (e.g. the held-out MT-Bench answers).

    ``expected_acceptance``: mean sum_x min(p, q) (acceptance of a sampled draft at T = 1);
    ``greedy_acceptance``: how often the adapter's argmax is the target's (a greedy draft's acceptance);
    ``top1``/``top5`` on the data's token t+1; ``predicted_chain_tau``: 1 + a + ... + a^gamma for the
    greedy acceptance a at gamma = ``max_draft_len`` (positions treated as independent).
    """
    obj = KangarooObjective(cache, target, model.exit_layer, chunk_len=1 << 30)
    acc, agree, hits1, hits5, n = 0.0, 0, 0, 0, 0
    for s in range(0, len(obj.chunks), windows_per_batch):
        b = obj.prepare(list(range(s, min(s + windows_per_batch, len(obj.chunks)))))
        lg = model(b.seqs).float()
        if model.draft_head is not None:  # target-id space, the dtype's minimum (q = 0) off the kept ids
            lg = model.draft_head.to_target(lg)
        acc += float(expected_acceptance(lg, b.teacher).sum())
        agree += topk_hits(lg, b.teacher.argmax(-1), ks=(1,))[1][0]
        h = topk_hits(lg, b.labels)
        hits1, hits5, n = hits1 + h[1][0], hits5 + h[5][0], n + b.positions
    a = agree / max(n, 1)
    return {"positions": n, "expected_acceptance": acc / max(n, 1), "greedy_acceptance": a,
            "top1": hits1 / max(n, 1), "top5": hits5 / max(n, 1),
            "predicted_chain_tau": sum(a ** k for k in range(model.max_draft_len + 1))}
