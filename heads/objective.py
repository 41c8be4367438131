"""Training objective for head drafters (Medusa now; Hydra builds on it).

Training samples are chunks of consecutive positions of one cached sequence,
so the teacher distribution at a position (target logits recomputed from the
cached final hidden state) is computed once and shared by every head.

Position convention (docs/methods.md section 10): head k (1-based) at position t
predicts token t+k+1, whose teacher distribution is the target's at t+k.
A label counts only if token t+k+1 is an assistant token of the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftsmith.common.vocab import draft_head
from draftsmith.common.hidden_cache import HiddenCache, head_logits, teacher_logits
from draftsmith.common.chunks import make_chunks
from draftsmith.common.losses import hard_ce, soft_ce, topk_hits


@dataclass
class HeadBatch:
    hidden: torch.Tensor | None  # [P, d]  h_t for every kept position t (None when ``seqs`` is used)
    labels: torch.Tensor   # [K, P]  token t+k+1 or -100
    teacher: torch.Tensor | None  # [K, P, V] teacher logits at t+k, only for soft losses
    next_tokens: torch.Tensor | None = None  # [P, K] tokens t+1..t+K (Hydra's teacher forcing)
    # Hydra++: per window (h_0..h_{hi-1} of its sequence, lo, kept rows), for the prefix layer
    seqs: list | None = None
    rows: torch.Tensor | None = None  # [P] absolute positions of the kept rows (one window)
    span: torch.Tensor | None = None  # one window's final states lo .. hi+K-1, for a teacher computed later
    offsets: torch.Tensor | None = None  # [P] the kept rows' offsets from lo (one window)

    @property
    def positions(self) -> int:
        return int(self.labels.shape[1])

    def to(self, device) -> "HeadBatch":
        mv = lambda x: None if x is None else x.to(device)  # noqa: E731
        seqs = None if self.seqs is None else [(mv(h), lo, mv(k)) for h, lo, k in self.seqs]
        return HeadBatch(mv(self.hidden), mv(self.labels), mv(self.teacher), mv(self.next_tokens), seqs)


def head_labels(tokens: np.ndarray, mask: np.ndarray, lo: int, hi: int, num_heads: int, offset: int = 1) -> np.ndarray:
    """[K, hi-lo] labels: token t+k+offset for head k (1-based), -100 where invalid."""
    n = len(tokens)
    out = np.full((num_heads, hi - lo), -100, dtype=np.int64)
    t = np.arange(lo, hi)
    for k in range(1, num_heads + 1):
        j = t + k + offset
        ok = j < n
        jj = j[ok]
        lab = np.where(mask[jj] > 0, tokens[jj], -100)
        out[k - 1, ok] = lab
    return out


class HeadObjective:
    """Builds batches from the cache and computes the weighted head loss."""

    def __init__(self, cache: HiddenCache, target, num_heads: int, loss: str = "hard", soft_weight: float = 0.5,
                 head_decay: float = 0.8, chunk_len: int = 128, exclude: set[int] | None = None):
        self.cache, self.target, self.K = cache, target, num_heads
        self.loss_kind, self.soft_weight, self.head_decay = loss, soft_weight, head_decay
        self.chunks = make_chunks(cache, chunk_len, exclude=exclude)
        # With a pruned draft head the soft teacher is needed over the kept ids only (renormalised there):
        # `use_pruned_teacher` makes the teacher's product those N rows instead of all V (V/N times cheaper).
        self.teacher_head = None
        if not self.chunks:
            raise ValueError("the cache holds no trainable positions (no assistant tokens); check the data stage")

    def use_pruned_teacher(self, head) -> None:
        """Compute teacher logits through ``head`` (a `PrunedHead` of the target's LM head, or None for all
        ids). Renormalising the full teacher over the kept ids equals a softmax over the kept logits, so
        the loss is unchanged; only the product is cheaper."""
        self.teacher_head = head

    def weights(self) -> list[float]:
        return [self.head_decay ** k for k in range(1, self.K + 1)]

    @torch.no_grad()
    def window(self, i: int, lo: int, hi: int, teacher: bool = False) -> HeadBatch | None:
        """Positions lo..hi-1 of sequence i that have at least one label (None if none do)."""
        tok, m = self.cache.tokens(i), self.cache.mask(i)
        lab = head_labels(tok, m, lo, hi, self.K)
        keep = (lab != -100).any(0)
        if not keep.any():
            return None
        keep_t = torch.from_numpy(keep)
        h = self.cache.states(i, "final", lo, hi + self.K)
        b = HeadBatch(h[: hi - lo][keep_t], torch.from_numpy(lab[:, keep]), None, rows=torch.arange(lo, hi)[keep_t],
                      span=h, offsets=torch.arange(hi - lo)[keep_t])
        if teacher:
            b.teacher = self.window_teacher(self.teacher_of(h), b)
        return b

    def teacher_of(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 teacher logits of final states [n, d] (over the kept ids with `use_pruned_teacher`)."""
        return teacher_logits(self.target, h) if self.teacher_head is None else head_logits(self.teacher_head, h)

    def window_teacher(self, tl: torch.Tensor, b: HeadBatch) -> torch.Tensor:
        """[K, P, V] teachers of a window's kept rows from the logits ``tl`` of its ``span`` (rows lo .. hi+K-1, fewer
        at a sequence's end): head k's row t reads the target's distribution at t+k."""
        n, rel = tl.shape[0], b.offsets
        return torch.stack([tl[torch.clamp(rel + k, max=n - 1)] for k in range(1, self.K + 1)])

    @staticmethod
    def collate(parts: list[HeadBatch]) -> HeadBatch:
        return HeadBatch(torch.cat([p.hidden for p in parts]), torch.cat([p.labels for p in parts], dim=1),
                         torch.cat([p.teacher for p in parts], dim=1) if parts[0].teacher is not None else None)

    @torch.no_grad()
    def prepare(self, chunk_ids: list[int]) -> HeadBatch:
        parts = [p for p in (self.window(*self.chunks[c]) for c in chunk_ids) if p is not None]
        if parts and self.loss_kind in ("soft", "mix"):
            # the teachers of every window through one product (16 windows of ~68 rows each ran at ~60% of the
            # CPU's matrix rate one by one, on a 2-core EPYC), then split back
            tl = self.teacher_of(torch.cat([p.span for p in parts]))
            at = 0
            for p in parts:
                p.teacher = self.window_teacher(tl[at: at + p.span.shape[0]], p)
                at += p.span.shape[0]
        return self.collate(parts)

    def logits(self, model, batch: HeadBatch) -> torch.Tensor:
        """[K, P, V] logits of every head at the batch's positions."""
        return model(batch.hidden)

    def loss(self, model, batch: HeadBatch) -> tuple[torch.Tensor, dict]:
        """Weighted head loss; returns (loss, aux) where aux feeds ``stats``.

        With a pruned draft vocabulary the logits cover the kept ids only: labels are mapped to
        draft ids (a pruned label leaves the loss but counts as a miss), and the teacher is
        renormalised over the kept ids.
        """
        logits = self.logits(model, batch)  # [K, P, V] (N when pruned)
        # one view per head (unbind's backward stacks their gradients once; indexing head by head would
        # write a zero [K, P, V] gradient per head and add them up)
        per_k = logits.unbind(0)
        dh = draft_head(model)
        total = logits.new_zeros(())
        per_head, hit_labels = [], []
        for k, w in enumerate(self.weights()):
            lab = hit = batch.labels[k]
            if dh is not None:
                lab, hit = dh.labels(lab)
            hit_labels.append(hit)
            lk = logits.new_zeros(())
            if self.loss_kind in ("hard", "mix"):
                lk = lk + (1 - self.soft_weight if self.loss_kind == "mix" else 1.0) * hard_ce(per_k[k], lab)
            if self.loss_kind in ("soft", "mix"):
                teacher = batch.teacher[k]
                if dh is not None and teacher.shape[-1] != logits.shape[-1]:  # a full-vocabulary teacher
                    teacher = teacher[..., dh.kept_ids]
                lk = lk + (self.soft_weight if self.loss_kind == "mix" else 1.0) * \
                    soft_ce(per_k[k], teacher, batch.labels[k] != -100)
            total = total + w * lk
            per_head.append(lk.detach())
        return total, {"logits": logits.detach(), "per_head": per_head, "hit_labels": hit_labels}

    @torch.no_grad()
    def stats(self, aux: dict, batch: HeadBatch) -> dict:
        """Per-head loss and top-1/top-5 (hits, count) of one micro-batch."""
        out = {}
        for k in range(self.K):
            hits = topk_hits(aux["logits"][k], aux["hit_labels"][k])
            out[f"head{k + 1}/loss"] = float(aux["per_head"][k])
            out[f"head{k + 1}/top1"] = hits[1]
            out[f"head{k + 1}/top5"] = hits[5]
        return out


class HydraObjective(HeadObjective):
    """Hydra heads: teacher-forced tokens t+1..t+K, and the prefix layer's full-sequence input.

    Head i at t predicts token t+i+1 (same labels and teachers as Medusa head
    i); it reads the embeddings of tokens t+1..t+i.
    """

    def __init__(self, *args, prefix_layer: bool = False, **kw):
        super().__init__(*args, **kw)
        self.prefix_layer = prefix_layer

    @torch.no_grad()
    def window(self, i: int, lo: int, hi: int, teacher: bool = False) -> HeadBatch | None:
        b = super().window(i, lo, hi, teacher)
        if b is None:
            return None
        tok = self.cache.tokens(i)
        idx = torch.clamp(b.rows[:, None] + torch.arange(1, self.K + 1)[None], max=len(tok) - 1)
        b.next_tokens = torch.from_numpy(tok.astype(np.int64))[idx]  # [P, K]
        if self.prefix_layer:
            keep = torch.zeros(hi - lo, dtype=torch.bool)
            keep[b.rows - lo] = True
            b.seqs = [(self.cache.states(i, "final", 0, hi), lo, keep)]
            b.hidden = None
        return b

    @staticmethod
    def collate(parts: list[HeadBatch]) -> HeadBatch:
        seqs = [s for p in parts for s in p.seqs] if parts[0].seqs is not None else None
        return HeadBatch(None if seqs else torch.cat([p.hidden for p in parts]),
                         torch.cat([p.labels for p in parts], dim=1),
                         torch.cat([p.teacher for p in parts], dim=1) if parts[0].teacher is not None else None,
                         torch.cat([p.next_tokens for p in parts]), seqs)

    def logits(self, model, batch: HeadBatch) -> torch.Tensor:
        # One call through the (possibly DDP-wrapped) module, so every trained weight is in its forward.
        return model(batch.hidden, batch.next_tokens, batch.seqs)
