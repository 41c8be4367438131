"""A pruned draft vocabulary for drafters that end in the target's output head (docs/methods.md section 8).

Keep the N most frequent target ids of the training data's assistant tokens
(FR-Spec / EAGLE-3 style). The drafter projects onto those N rows of the
target's LM head only, which makes both training (the LM-head product and its
softmax dominate a head's cost) and drafting N/V times cheaper.

Lossless rule: the decoder gets the drafter's real proposal in target-id space,
the kept logits at the kept ids and the dtype's minimum everywhere else, so a
pruned id has probability exactly 0 under q, is never drafted, and
verification uses the q the token was drawn from.

Training is against the target distribution renormalised over the kept ids
(soft loss) or the target's token when it is kept (hard loss); a label outside
the kept set cannot be learned and is left out of the loss, but it counts as a
miss in accuracy, so acceptance is never overstated.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from draftsmith.checkpoint import CheckpointError
from draftsmith.common.int8 import cast_copy, quantised


def kept_size(keep: int | float, vocab_size: int) -> int:
    """``keep`` as an id count: an int N, or a float ratio in (0, 1] of the vocabulary."""
    if isinstance(keep, bool):
        raise ValueError("vocab_keep must be an id count or a ratio, not a bool")
    n = int(round(keep * vocab_size)) if isinstance(keep, float) and keep <= 1.0 else int(keep)
    if n < 1 or n > vocab_size:
        raise ValueError(f"vocab_keep {keep!r} gives {n} kept ids; it must keep between 1 and the "
                         f"vocabulary's {vocab_size} ids")
    return n


def frequent_ids(token_arrays, mask_arrays, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent ids among assistant tokens (mask > 0), sorted by id; ties by lower id."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tok, m in zip(token_arrays, mask_arrays):
        t = np.asarray(tok)[np.asarray(m) > 0]
        if t.size:
            counts += np.bincount(t, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, then lower id
    return torch.from_numpy(np.sort(order[:n])).long()


def answer_coverage(token_arrays, mask_arrays, kept) -> tuple[float, int]:
    """The share of the assistant tokens (mask > 0) that are ids in ``kept``, and how many assistant tokens there
    were (the training log's "covering N% of the training assistant tokens")."""
    kept = np.asarray(kept)
    total = hit = 0
    for tok, m in zip(token_arrays, mask_arrays):
        t = np.asarray(tok)[np.asarray(m) > 0]
        total += len(t)
        hit += int(np.isin(t, kept).sum())
    return hit / max(total, 1), total


class PrunedHead(nn.Linear):
    """The target's LM head restricted to ``kept_ids``: [..., d] -> [..., N] logits (frozen).

    The kept rows are stored (N x d), so a checkpoint is self-contained (vLLM's
    Medusa loader takes the same pair: truncated head + token map).
    """

    def __init__(self, full: nn.Module, kept_ids: torch.Tensor):
        w = full.weight
        super().__init__(w.shape[1], len(kept_ids), bias=False, device=w.device, dtype=w.dtype)
        self.register_buffer("kept_ids", kept_ids.to(w.device).long().clone())
        self.vocab_size = int(w.shape[0])
        self.set_kept(kept_ids, full)
        self.requires_grad_(False)

    @torch.no_grad()
    def set_kept(self, kept_ids: torch.Tensor, full: nn.Module) -> None:
        """Take rows ``kept_ids`` (sorted, unique target ids) of ``full``'s weight."""
        ids = kept_ids.to(self.weight.device).long()
        if ids.numel() != self.weight.shape[0]:
            raise ValueError(f"{ids.numel()} kept ids for a head of {self.weight.shape[0]} rows")
        if ids.numel() and (bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0
                            or int(ids.max()) >= self.vocab_size):
            raise ValueError("kept ids must be sorted, unique target ids")
        self.kept_ids.copy_(ids)
        self.weight.copy_(full.weight.detach()[ids])

    def t2d(self) -> torch.Tensor:
        """[V] target id -> draft id, -1 where pruned."""
        m = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.kept_ids.device)
        m[self.kept_ids] = torch.arange(len(self.kept_ids), device=m.device)
        return m

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., N] draft logits -> [..., V] in target-id space, the dtype's minimum at pruned ids."""
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), torch.finfo(logits.dtype).min)
        out[..., self.kept_ids] = logits
        return out

    def labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target-id labels -> (loss labels: draft ids, -100 where pruned or absent;
        hit labels: draft ids, N (never a hit) where pruned, -100 where absent)."""
        t2d = self.t2d()
        valid = labels != -100
        d = torch.where(valid, t2d[labels.clamp(min=0)], torch.full_like(labels, -100))
        loss_lab = torch.where(d < 0, torch.full_like(d, -100), d)
        hit_lab = torch.where(valid & (d < 0), torch.full_like(d, len(self.kept_ids)), d)
        return loss_lab, hit_lab


class PrunedVocab:
    """The pruned-vocabulary part of a drafter kind (Medusa, Hydra, EAGLE-3, Kangaroo, the standalone drafter):
    ``draft_head``, a frozen `PrunedHead` over ``vocab_keep`` of the target's ids taken from the kind's full head
    (`full_head`, default ``self.lm_head``), or None when the kind drafts over the full vocabulary.

    The kept ids are given at construction (``kept_ids``) or, by default, the first ``vocab_keep`` ids until the
    trainer sets the data's most frequent ones (`set_draft_vocab`); a checkpoint stores them either way."""

    draft_head: PrunedHead | None

    def init_pruned_vocab(self, full: nn.Module, vocab_keep: int | None, kept_ids: torch.Tensor | None = None) -> None:
        if not vocab_keep:
            if kept_ids is not None:
                raise ValueError("kept ids were given for a drafter over the full vocabulary (vocab_keep is not set)")
            self.draft_head = None
            return
        ids = torch.arange(int(vocab_keep)) if kept_ids is None else kept_ids
        if len(ids) != int(vocab_keep):
            raise ValueError(f"{len(ids)} kept ids for vocab_keep {vocab_keep}")
        self.draft_head = PrunedHead(full, ids)

    def full_head(self) -> nn.Module:
        """The head the kept rows are taken from."""
        return self.lm_head

    def set_draft_vocab(self, kept_ids: torch.Tensor) -> None:
        """Draft over ``kept_ids`` (sorted, unique target ids, ``vocab_keep`` of them); the trainer calls it with
        the training data's most frequent assistant tokens."""
        if self.draft_head is None:
            raise ValueError(f"this {self.kind} drafter drafts over the full vocabulary (vocab_keep is not set)")
        self.draft_head.set_kept(kept_ids, self.full_head())
        self.draft_vocab_set()

    def draft_vocab_set(self) -> None:
        """Called after `set_draft_vocab` (a kind with state derived from the kept ids updates it here)."""

    def vocab_logits(self, x: torch.Tensor) -> torch.Tensor:
        """States -> logits over the draft vocabulary ([..., N] pruned, [..., V] otherwise)."""
        return self.draft_head(x) if self.draft_head is not None else self.full_head()(x)


class TargetIdHead(nn.Module):
    """A `PrunedVocab` drafter's head as compiled drafting runs it: states [n, H] -> logits in target-id space
    [n, V], the dtype's minimum off the kept ids (what `PrunedHead.to_target` gives); ``int8``: a quantised copy of
    the head (`draftsmith.common.int8`)."""

    def __init__(self, module: nn.Module, int8: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        dh = module.draft_head
        head = dh if dh is not None else module.full_head()
        if dtype is not None:  # drafting in another dtype than the head's (the target's full LM head, say): a copy
            head = cast_copy(head, dtype)
        self.head = quantised(head) if int8 else head
        self.vocab_size = int(dh.vocab_size) if dh is not None else None
        if dh is not None:
            self.register_buffer("kept_ids", dh.kept_ids.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.head(x)
        if self.vocab_size is None:
            return kept
        full = kept.new_full((x.shape[0], self.vocab_size), torch.finfo(kept.dtype).min)
        return full.index_copy(1, self.kept_ids, kept)


def draft_head(module: nn.Module) -> PrunedHead | None:
    """The pruned head of a (possibly DDP-wrapped) drafter, or None when it drafts over the full vocabulary."""
    m = getattr(module, "module", module)
    return getattr(m, "draft_head", None)


# ---------------------------------------------------------------- the engines' vocabulary maps (EAGLE's d2t / t2d)
def vocab_maps(kept: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """A draft vocabulary (``kept``: sorted target ids) as the engines store it: ``d2t``, int64 offsets (target id =
    draft id + d2t[draft id]), and ``t2d``, a bool over the target vocabulary."""
    kept = kept.long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=kept.device)
    t2d[kept] = True
    return {"d2t": kept - torch.arange(len(kept), device=kept.device), "t2d": t2d}


def kept_from_maps(tensors: dict, n_draft: int, vocab_size: int, where) -> torch.Tensor:
    """The kept target ids an export's ``d2t`` (and ``t2d``, where present) give for ``n_draft`` draft ids; all ids
    when it has no ``d2t`` and drafts over the whole vocabulary. `CheckpointError` naming ``where`` otherwise."""
    if "d2t" not in tensors:
        if n_draft != vocab_size:
            raise CheckpointError(f"{where}: no d2t, and draft_vocab_size {n_draft} is not the target's vocabulary "
                                  f"({vocab_size}): the draft ids cannot be mapped")
        return torch.arange(vocab_size)
    d2t = tensors["d2t"].long()
    if d2t.shape != (n_draft,):
        raise CheckpointError(f"{where}: d2t has shape {list(d2t.shape)}, draft_vocab_size is {n_draft}")
    kept = torch.arange(n_draft) + d2t
    if bool((kept[1:] <= kept[:-1]).any()) or int(kept.min()) < 0 or int(kept.max()) >= vocab_size:
        raise CheckpointError(f"{where}: d2t does not map the draft ids to sorted, distinct target ids below "
                              f"{vocab_size}")
    t2d = tensors.get("t2d")
    if t2d is not None and (t2d.shape != (vocab_size,) or not torch.equal(t2d.bool().nonzero()[:, 0], kept)):
        raise CheckpointError(f"{where}: t2d does not agree with d2t")
    return kept


@torch.no_grad()
def copy_tensors(module: nn.Module, tensors: dict, names: dict[str, str], where) -> None:
    """Copy ``tensors[theirs]`` into ``module``'s parameter ``ours`` for each (ours, theirs) of ``names``, checking
    presence and shape (`CheckpointError` naming ``where`` and the tensor)."""
    own = module.state_dict()
    for ours, theirs in names.items():
        t = tensors.get(theirs)
        if t is None:
            raise CheckpointError(f"{where}: no tensor {theirs!r}")
        if tuple(t.shape) != tuple(own[ours].shape):
            raise CheckpointError(f"{where}: {theirs!r} has shape {list(t.shape)}, expected {list(own[ours].shape)}")
        module.get_parameter(ours).copy_(t.to(own[ours].dtype))
