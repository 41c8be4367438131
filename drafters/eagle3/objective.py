"""EAGLE-3's training objective on the hidden-state cache: the training-time test.

A training example is one cached sequence (a chunk [lo, hi) of it: losses count at indices lo..hi-1, the
indices before lo still give keys). Step k at index i predicts token t_{i+k+2}; its soft label is the
target's distribution at position i+k+1 (recomputed from the cached final state through the target's
head) restricted to the draft vocabulary and renormalised. A step-k position counts when t_{i+k+2} is an
assistant token and the target's argmax there is inside the draft vocabulary (EAGLE's position mask).
Loss: sum_k step_decay**k * (masked mean of the soft cross-entropy of step k).

Reported per step: top-1 agreement with the target's argmax (``stepK/top1``) and the same conditional on
steps 1..K-1 agreeing at that index (``stepK/top1_cond``), which is what a chain's acceptance follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftsmith.common.chunks import make_chunks
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.common.losses import add_hits, chain_metrics
from draftsmith.common.vocab import PrunedHead, draft_head


@dataclass
class Eagle3Batch:
    feats: torch.Tensor  # [B, T, 3H] fused target states f_i
    next_ids: torch.Tensor  # [B, T + K] token t_{i+1} at column i (0 past the end)
    teacher: torch.Tensor  # [B, T + K, N] target logits at position j over the draft vocabulary
    valid: torch.Tensor  # [K, B, T] step k counts at index i

    @property
    def positions(self) -> int:
        return int(self.valid[0].sum())

    def to(self, device) -> "Eagle3Batch":
        return Eagle3Batch(self.feats.to(device), self.next_ids.to(device), self.teacher.to(device),
                           self.valid.to(device))


class Eagle3Objective:
    def __init__(self, cache: HiddenCache, target, aux_layers: list[int], steps: int = 7, decay: float = 0.8,
                 chunk_len: int = 512, exclude: set[int] | None = None):
        self.needs = [f"layer:{int(i)}" for i in aux_layers]
        have = cache.index.get("needs", [])
        missing = [n for n in [*self.needs, "final"] if n not in have]
        if missing:
            raise ValueError(f"cache {cache.path} holds {have}; this EAGLE-3 drafter needs {missing} too: rebuild "
                             f"it (draftsmith cache RECIPE into a fresh output dir)")
        self.cache, self.target, self.steps, self.decay = cache, target, steps, decay
        self.kept: torch.Tensor | None = None
        self.t2d: torch.Tensor | None = None
        self.chunks = make_chunks(cache, chunk_len, min_offset=2, exclude=exclude)
        if not self.chunks:
            raise ValueError("the cache holds no trainable positions (no assistant tokens); check the data stage")

    def use_pruned_teacher(self, head: PrunedHead | None) -> None:
        """Draft over ``head``'s kept ids (set by the trainer once it has chosen them)."""
        if head is not None:
            self.kept, self.t2d = head.kept_ids.cpu(), head.t2d().cpu()

    @torch.no_grad()
    def example(self, i: int, lo: int, hi: int):
        """(feats [hi, 3H], next ids, teacher over the draft vocabulary, valid [K, hi]) for sequence i."""
        tok, m = self.cache.tokens(i), self.cache.mask(i)
        n, K = len(tok), self.steps
        T = hi
        feats = torch.cat([self.cache.states(i, nd, 0, T) for nd in self.needs], dim=-1)
        end = min(n, T + K + 1)
        z = teacher_logits(self.target, self.cache.states(i, "final", 0, end)).cpu()  # [end, V]
        am = z.argmax(-1)
        if self.kept is not None:
            z = z[:, self.kept]
        in_vocab = np.ones(len(am), dtype=bool) if self.t2d is None else (self.t2d[am] >= 0).numpy()
        nxt = torch.zeros(T + K, dtype=torch.long)
        nxt[: min(T + K, n - 1)] = torch.from_numpy(tok[1: 1 + min(T + K, n - 1)].astype(np.int64))
        teacher = z.new_zeros(T + K, z.shape[-1])
        r = min(end, T + K)
        teacher[:r] = z[:r]
        valid = np.zeros((K, T), dtype=bool)
        idx = np.arange(T)
        for k in range(K):
            lab = idx + k + 2  # the token step k predicts; the target's distribution for it sits at lab - 1
            ok = (idx >= lo) & (lab < n)
            ok[ok] &= (m[lab[ok]] > 0) & in_vocab[lab[ok] - 1]
            valid[k] = ok
        return feats, nxt, teacher, torch.from_numpy(valid)

    @torch.no_grad()
    def prepare(self, chunk_ids: list[int]) -> Eagle3Batch:
        parts = [self.example(*self.chunks[c]) for c in chunk_ids]
        B, K = len(parts), self.steps
        T = max(p[0].shape[0] for p in parts)
        feats = parts[0][0].new_zeros(B, T, parts[0][0].shape[-1])
        nxt = torch.zeros(B, T + K, dtype=torch.long)
        teacher = parts[0][2].new_zeros(B, T + K, parts[0][2].shape[-1])
        valid = torch.zeros(K, B, T, dtype=torch.bool)
        for b, (f, x, z, v) in enumerate(parts):
            t = f.shape[0]
            feats[b, :t], nxt[b, : t + K], teacher[b, : t + K], valid[:, b, :t] = f, x, z, v
        return Eagle3Batch(feats, nxt, teacher, valid)

    def loss(self, model, batch: Eagle3Batch) -> tuple[torch.Tensor, dict]:
        steps = model(batch.feats, batch.next_ids)
        T = batch.feats.shape[1]
        total = batch.feats.new_zeros(())
        for k, logits in enumerate(steps):
            v = batch.valid[k]
            if not v.any():
                continue
            p = torch.softmax(batch.teacher[:, k + 1: k + 1 + T].float(), dim=-1)
            logq = torch.log_softmax(logits.float(), dim=-1)
            ce = -(p * logq).sum(-1)  # [B, T]
            total = total + (self.decay ** k) * ce[v].mean()
        return total, {"steps": [s.detach() for s in steps]}

    @torch.no_grad()
    def stats(self, aux: dict, batch: Eagle3Batch) -> dict:
        return step_agreement(aux["steps"], batch)


def step_agreement(steps: list[torch.Tensor], batch: Eagle3Batch) -> dict:
    """Per step: (hits, positions) of top-1 agreement with the target, plain and conditional on earlier steps."""
    T = batch.feats.shape[1]
    out, run = {}, None
    for k, logits in enumerate(steps):
        v = batch.valid[k]
        hit = logits.argmax(-1) == batch.teacher[:, k + 1: k + 1 + T].argmax(-1)
        out[f"step{k + 1}/top1"] = (int((hit & v).sum()), int(v.sum()))
        if run is not None:
            c = v & run
            out[f"step{k + 1}/top1_cond"] = (int((hit & c).sum()), int(c.sum()))
        run = hit if run is None else run & hit
    return out


def _ttt_batches(model, cache: HiddenCache, target, exclude: set[int] | None = None, batch_size: int = 4):
    """(batch, per-step logits) of the training-time test over the whole sequences of ``cache`` (less
    ``exclude``), the teacher over the drafter's draft vocabulary: what the evaluation figures read."""
    model.eval()
    obj = Eagle3Objective(cache, target, model.aux_layers, model.ttt_steps, model.step_decay, chunk_len=1 << 30,
                          exclude=exclude)
    obj.use_pruned_teacher(draft_head(model))
    dev = next(model.parameters()).device
    ids = list(range(len(obj.chunks)))
    for s in range(0, len(ids), batch_size):
        batch = obj.prepare(ids[s: s + batch_size]).to(dev)
        yield batch, model.ttt(batch.feats, batch.next_ids)


@torch.no_grad()
def heldout_metrics(model, cache: HiddenCache, target, batch_size: int = 4) -> dict:
    """Per-step and conditional top-1 agreement over every sequence of a held-out cache, and the chain's
    predicted acceptance length 1 + sum_k prod_{j<=k} (conditional agreement of step j)."""
    acc: dict[str, list[int]] = {}
    for batch, steps in _ttt_batches(model, cache, target, batch_size=batch_size):
        add_hits(acc, step_agreement(steps, batch))
    return chain_metrics(acc, model.ttt_steps)


@torch.no_grad()
def rank_acceptance(model, cache: HiddenCache, target, sequences=None, ranks: int = 10, batch_size: int = 4) -> dict:
    """What static trees are built from (`draftsmith.engine.tree_build.build_trees`): ``rank_acc[k][r]``, how often
    the target's argmax at step k+1 is the draft's r-th ranked token, over the indices where steps 1..k drafted
    the target's argmax first (a tree node's children on the accepted path, as the conditional top-1 of
    `heldout_metrics`); over every sequence of ``cache`` or those in ``sequences``."""
    exclude = None if sequences is None else set(range(len(cache))) - set(sequences)
    K = model.ttt_steps
    hits, count = torch.zeros(K, ranks), torch.zeros(K)
    for batch, steps in _ttt_batches(model, cache, target, exclude, batch_size):
        T = batch.feats.shape[1]
        run = None
        for k, logits in enumerate(steps):
            lab = batch.teacher[:, k + 1: k + 1 + T].argmax(-1)
            top = logits.topk(min(ranks, logits.shape[-1]), dim=-1).indices
            eq = (top == lab.unsqueeze(-1)).cpu()
            v = batch.valid[k].cpu() if run is None else batch.valid[k].cpu() & run
            hits[k, : eq.shape[-1]] += eq[v].float().sum(0)
            count[k] += v.sum()
            run = eq[..., 0] if run is None else run & eq[..., 0]
    rank_acc = [[float(hits[k, r] / count[k]) if count[k] else 0.0 for r in range(ranks)] for k in range(K)]
    return {"rank_acc": rank_acc, "positions": count.tolist(), "top1": [r[0] for r in rank_acc]}
