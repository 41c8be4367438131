"""DFlash's training objective on the hidden-state cache: every anchor's block of a sequence in one forward.

A training example is one cached sequence (a chunk [lo, hi) of it: anchors are drawn in lo..hi-1, the positions
before still give context). An anchor a is an assistant token followed by another one (at decoding, the block's
first token is one the target produced); up to ``max_anchors`` of them are drawn at random per sequence, without
replacement. Block j reads [t_a, MASK x (S-1)] at positions a..a+S-1 over the context of positions < a; its slot
k (k >= 1) predicts t_{a+k}, and counts where t_{a+k} is an assistant token (and, with a pruned head and the
teacher's labels, where the target's argmax is in the draft vocabulary).

Loss per counted slot (the recipe's ``train.loss``): ``hard``, cross-entropy on the data's token (SpecForge's);
``soft``, cross-entropy on the target's distribution at a+k-1 (recomputed from the cached final state, restricted
to the draft vocabulary and renormalised: a KL up to a constant, speculators' earlier default); ``mix``, their
mean. Each weighted by exp(-(k-1)/gamma) and averaged over the weights. Reported per slot: top-1 agreement with
the target's argmax (``stepK/top1``) and the same conditional on slots 1..K-1 agreeing in that block
(``stepK/top1_cond``), which a chain's acceptance follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from draftsmith.common.chunks import make_chunks
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.common.losses import add_hits, chain_metrics
from draftsmith.common.vocab import PrunedHead, draft_head


@dataclass
class DFlashBatch:
    feats: torch.Tensor  # [B, T, n x H] target states of positions 0..T-1
    ids: torch.Tensor  # [B, A, S] block tokens (anchor, then mask tokens)
    anchors: torch.Tensor  # [B, A] block j's first position (0 where unused)
    labels: torch.Tensor  # [B, A, S] the data's token t_{a+k}, in draft-vocabulary ids (-1: not in it)
    teacher: torch.Tensor  # [M, N] target logits for t_{a+k} over the draft vocabulary, one row per counted slot
    valid: torch.Tensor  # [B, A, S] slot k of block j counts (M of them, in row-major order)

    @property
    def positions(self) -> int:
        return int(self.valid[..., 1].sum())

    def to(self, device) -> "DFlashBatch":
        return DFlashBatch(*(t.to(device) for t in (self.feats, self.ids, self.anchors, self.labels, self.teacher,
                                                     self.valid)))


def slot_weights(S: int, gamma: float | None) -> torch.Tensor:
    """[S]: slot 0 weighs 0 (the anchor is given), slot k >= 1 weighs exp(-(k-1)/gamma) (1 with no gamma)."""
    w = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) if gamma else 1.0 for k in range(1, S)])
    return w


class DFlashObjective:
    def __init__(self, cache: HiddenCache, target, target_layers: list[int], block_size: int = 8,
                 gamma: float | None = 4.0, max_anchors: int | None = 512, loss: str = "hard", chunk_len: int = 1024,
                 exclude: set[int] | None = None, seed: int = 0, mask_token_id: int | None = None):
        self.needs = [f"layer:{int(i)}" for i in target_layers]
        have = cache.index.get("needs", [])
        missing = [n for n in [*self.needs, "final"] if n not in have]
        if missing:
            raise ValueError(f"cache {cache.path} holds {have}; this DFlash drafter needs {missing} too: rebuild "
                             f"it (draftsmith cache RECIPE into a fresh output dir)")
        if loss not in ("hard", "soft", "mix"):
            raise ValueError(f"DFlash trains with train.loss hard, soft or mix, not {loss!r}")
        self.cache, self.target, self.S, self.gamma = cache, target, int(block_size), gamma
        self.max_anchors, self.loss_kind = max_anchors, loss
        self.mask_token_id = mask_token_id
        self.kept: torch.Tensor | None = None
        self.t2d: torch.Tensor | None = None
        self.rng = np.random.default_rng(seed)
        self.chunks = make_chunks(cache, chunk_len, min_offset=1, exclude=exclude)
        if not self.chunks:
            raise ValueError("the cache holds no trainable positions (no assistant tokens); check the data stage")

    def use_pruned_teacher(self, head: PrunedHead | None) -> None:
        """Draft over ``head``'s kept ids (set by the trainer once it has chosen them)."""
        if head is not None:
            self.kept, self.t2d = head.kept_ids.cpu(), head.t2d().cpu()

    @torch.no_grad()
    def example(self, i: int, lo: int, hi: int, every: bool = False):
        """(feats [hi, n x H], ids [A, S], anchors [A], labels [A, S], teacher [M, N], valid [A, S]) for
        sequence i: up to ``max_anchors`` blocks anchored in lo..hi-1 (``every``: all of them)."""
        if self.mask_token_id is None:
            raise ValueError("the DFlash objective needs the drafter's mask_token_id")
        tok, m = self.cache.tokens(i), self.cache.mask(i)
        n, S = len(tok), self.S
        cand = np.arange(max(lo, 1), min(hi, n - 1))
        cand = cand[(m[cand] > 0) & (m[cand + 1] > 0)]
        if not every and self.max_anchors and len(cand) > self.max_anchors:
            cand = np.sort(self.rng.choice(cand, self.max_anchors, replace=False))
        A = len(cand)
        feats = torch.cat([self.cache.states(i, nd, 0, hi) for nd in self.needs], dim=-1)
        slots = cand[:, None] + np.arange(S)[None, :]  # [A, S] the position slot k drafts
        inside = slots < n
        tgt_pos = np.minimum(slots, n - 1)
        valid = inside & (m[tgt_pos] > 0)
        valid[:, 0] = False
        ids = np.full((A, S), self.mask_token_id, dtype=np.int64)
        ids[:, 0] = tok[cand]
        end = min(n, int(cand.max()) + S) if A else 1
        z = teacher_logits(self.target, self.cache.states(i, "final", 0, end)).cpu()  # [end, V]: position j -> t_{j+1}
        am = z.argmax(-1)
        if self.kept is not None:
            z = z[:, self.kept]
        zpos = torch.from_numpy(np.clip(tgt_pos - 1, 0, end - 1))
        teacher = z[zpos]  # [A, S, N]
        labels = torch.from_numpy(tok[tgt_pos].astype(np.int64)).reshape(A, S)
        if self.t2d is not None:
            labels = self.t2d[labels]
            valid &= (self.t2d[am[zpos]] >= 0).numpy()
            if self.loss_kind == "hard":
                valid &= (labels >= 0).numpy()
        valid_t = torch.from_numpy(valid)
        teacher = teacher[valid_t]
        return feats, torch.from_numpy(ids), torch.from_numpy(cand.astype(np.int64)), labels, teacher, valid_t

    @torch.no_grad()
    def prepare(self, chunk_ids: list[int], every: bool = False) -> DFlashBatch:
        parts = [self.example(*self.chunks[c], every=every) for c in chunk_ids]
        B, S = len(parts), self.S
        T = max(p[0].shape[0] for p in parts)
        A = max(1, max(p[1].shape[0] for p in parts))
        feats = parts[0][0].new_zeros(B, T, parts[0][0].shape[-1])
        ids = torch.full((B, A, S), int(self.mask_token_id), dtype=torch.long)
        anchors = torch.zeros(B, A, dtype=torch.long)
        labels = torch.full((B, A, S), -1, dtype=torch.long)
        teacher = torch.cat([p[4] for p in parts])
        valid = torch.zeros(B, A, S, dtype=torch.bool)
        for b, (f, x, a, lab, z, v) in enumerate(parts):
            t, na = f.shape[0], x.shape[0]
            feats[b, :t], ids[b, :na], anchors[b, :na] = f, x, a
            labels[b, :na], valid[b, :na] = lab, v
        return DFlashBatch(feats, ids, anchors, labels, teacher, valid)

    def loss(self, model, batch: DFlashBatch) -> tuple[torch.Tensor, dict]:
        v = batch.valid
        logits = model(batch.feats, batch.ids, batch.anchors, v)  # [M, N]: the counted slots only
        w = slot_weights(self.S, self.gamma).to(logits.device)[None, None, :].expand_as(v)[v]
        if not v.any():
            return logits.sum() * 0.0, {"logits": logits.detach()}
        logq = torch.log_softmax(logits.float(), dim=-1)  # [M, N]
        parts = []
        if self.loss_kind in ("soft", "mix"):
            p = torch.softmax(batch.teacher.float(), dim=-1)
            parts.append(-(p * logq).sum(-1))
        if self.loss_kind in ("hard", "mix"):
            lab = batch.labels[v]
            ok = lab >= 0  # soft labels count a slot whose data token is outside the draft vocabulary
            hard = torch.zeros_like(w)
            hard[ok] = -logq[ok].gather(-1, lab[ok][:, None])[:, 0]
            parts.append(hard)
        ce = sum(parts) / len(parts)
        return (w * ce).sum() / w.sum().clamp_min(1e-9), {"logits": logits.detach()}

    @torch.no_grad()
    def stats(self, aux: dict, batch: DFlashBatch) -> dict:
        return slot_agreement(aux["logits"], batch)


def slot_agreement(logits: torch.Tensor, batch: DFlashBatch) -> dict:
    """Per slot k >= 1: (hits, positions) of top-1 agreement with the target's argmax, plain and conditional on
    slots 1..k-1 agreeing in the same block; ``logits`` [M, N] of the counted slots."""
    hit = torch.zeros_like(batch.valid)
    hit[batch.valid] = logits.argmax(-1) == batch.teacher.argmax(-1)  # [B, A, S]
    out, run = {}, None
    for k in range(1, batch.valid.shape[2]):
        v = batch.valid[..., k]
        out[f"step{k}/top1"] = (int((hit[..., k] & v).sum()), int(v.sum()))
        if run is not None:
            c = v & run
            out[f"step{k}/top1_cond"] = (int((hit[..., k] & c).sum()), int(c.sum()))
        run = hit[..., k] if run is None else run & hit[..., k]
    return out


def _every_block(model, cache: HiddenCache, target, exclude: set[int] | None = None, batch_size: int = 4):
    """(batch, logits of its counted slots) for every anchor of every sequence of ``cache`` (less ``exclude``), the
    teacher over the drafter's draft vocabulary: what the evaluation figures read."""
    m = getattr(model, "module", model)
    was = m.training
    m.eval()
    c = m.config
    obj = DFlashObjective(cache, target, m.target_layers, m.block_size, gamma=c.gamma, max_anchors=None,
                          loss="soft", chunk_len=1 << 30, exclude=exclude, mask_token_id=c.mask_token_id)
    obj.use_pruned_teacher(draft_head(m))
    dev = next(m.parameters()).device
    ids = list(range(len(obj.chunks)))
    try:
        for s in range(0, len(ids), batch_size):
            batch = obj.prepare(ids[s: s + batch_size], every=True).to(dev)
            yield batch, m(batch.feats, batch.ids, batch.anchors, batch.valid)
    finally:
        m.train(was)


@torch.no_grad()
def heldout_metrics(model, cache: HiddenCache, target, batch_size: int = 4) -> dict:
    """Per-slot and conditional top-1 agreement over every anchor of every sequence of a held-out cache, and the
    chain's predicted acceptance length 1 + sum_k prod_{j<=k} (conditional agreement of slot j)."""
    m = getattr(model, "module", model)
    acc: dict[str, list[int]] = {}
    for batch, logits in _every_block(m, cache, target, batch_size=batch_size):
        add_hits(acc, slot_agreement(logits, batch))
    return chain_metrics(acc, m.block_size - 1)


@torch.no_grad()
def rank_acceptance(model, cache: HiddenCache, target, sequences=None, ranks: int = 10, batch_size: int = 4) -> dict:
    """What static trees are built from (`draftsmith.engine.tree_build.build_trees`): ``rank_acc[k][r]``, how often
    the target's argmax for slot k+1 is that slot's r-th ranked draft, over the blocks whose slots 1..k drafted
    the target's argmax first (a node's children on the accepted path); over every sequence of ``cache`` or
    those in ``sequences``."""
    m = getattr(model, "module", model)
    K = m.block_size - 1
    exclude = None if sequences is None else set(range(len(cache))) - set(sequences)
    hits, count = torch.zeros(K, ranks), torch.zeros(K)
    for batch, logits in _every_block(m, cache, target, exclude, batch_size):
        v = batch.valid.cpu()
        top = logits.topk(min(ranks, logits.shape[-1]), dim=-1).indices.cpu()
        eq = torch.zeros(*v.shape, top.shape[-1], dtype=torch.bool)
        eq[v] = top == batch.teacher.argmax(-1).cpu()[:, None]
        run = None
        for k in range(1, K + 1):
            vk = v[..., k] if run is None else v[..., k] & run
            hits[k - 1, : eq.shape[-1]] += eq[..., k, :][vk].float().sum(0)
            count[k - 1] += vk.sum()
            run = eq[..., k, 0] if run is None else run & eq[..., k, 0]
    rank_acc = [[float(hits[k, r] / count[k]) if count[k] else 0.0 for r in range(ranks)] for k in range(K)]
    return {"rank_acc": rank_acc, "positions": count.tolist(), "top1": [r[0] for r in rank_acc]}
