"""One update of the online job: what it trains on and how (called by `train.online.OnlineJob.apply`).

OSD emphasis (a choice stated once): for every rejected position p of a record
(see `TrafficRecord.rejected_positions`) the update adds ``osd_weight`` copies
of the chunk ``[p - 9, p + 1)`` of that sequence to the objective's chunks, so
the positions whose predictions target token p (head k at p-k-1; a
next-token drafter at p-1) are sampled ``osd_weight`` more times. It works
with any kind, since every objective trains on ``(sequence, lo, hi)`` chunks.
The windows are capped at ``osd_max_share`` per training chunk (a seeded
sample): at low acceptance nearly every position is a rejection, and
uncapped windows swamped the chunks (27 to 1 on the real target; both
candidates memorised their records and the gate refused them).

Anchor conversations (``anchor_data``, ``anchor_ratio``): a seeded sample of a
regenerated conversations file (e.g. the drafter's own training data) joins
the update's cache pass, against forgetting the general traffic.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from draftsmith.recipe import Recipe
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.generate import sequence_from_line
from draftsmith.train.training.trainer import make_objective, teach_over_draft_vocab, train_step

EMPHASIS_BEFORE = 9  # positions before a rejected token covered by its emphasis window


def emphasis_chunks(cache: HiddenCache, rejected: dict[int, list[int]], weight: int) -> list[tuple[int, int, int]]:
    """``weight`` copies of ``[p - 9, p + 1)`` for every rejected position p of cached sequence i."""
    out = []
    if weight <= 0:
        return out
    for i, ps in rejected.items():
        n, m = len(cache.tokens(i)), cache.mask(i)
        for p in ps:
            if 2 <= p < n and m[p] > 0:
                out += [(i, max(0, p - EMPHASIS_BEFORE), p + 1)] * weight
    return out


def cap_emphasis(windows: list, chunks: int, share: float | None, seed: int) -> list:
    """At most ``share * chunks`` of the emphasis windows (a seeded sample, order kept); None: all."""
    if share is None or len(windows) <= int(share * chunks):
        return windows
    keep = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))[: int(share * chunks)]
    return [windows[i] for i in sorted(keep.tolist())]


def update_module(module: torch.nn.Module, recipe: Recipe, target, cache_dir: Path,
                  rejected: dict[int, list[int]], *, seed: int) -> dict:
    """Train ``module`` in place on a cache (constant lr, fresh AdamW, the training loops' `train_step`); returns
    the update's stats."""
    o = recipe.online
    # every cached sequence trains: held-back records never reach the cache
    r = recipe.model_copy(update={"train": recipe.train.model_copy(update={"calibration_every": 0})})
    cache = HiddenCache(cache_dir, target)
    try:
        obj = make_objective(r, cache, target)
    except ValueError as e:  # no trainable positions
        return {"steps": 0, "skipped": str(e)}
    teach_over_draft_vocab(obj, module)
    base = len(obj.chunks)
    emph = emphasis_chunks(cache, rejected, o.osd_weight)
    found = len(emph)
    emph = cap_emphasis(emph, base, o.osd_max_share, seed + 1)
    obj.chunks = list(obj.chunks) + emph
    steps = max(1, math.ceil(o.epochs * len(obj.chunks) / o.batch_size))
    if o.max_steps:
        steps = min(steps, o.max_steps)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=recipe.train.weight_decay)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(obj.chunks), generator=g).tolist()
    losses = []
    module.zero_grad(set_to_none=True)  # nothing left from an earlier update joins the first step
    module.train()
    for s in range(steps):  # the training loops' own step (`train_step`), at a constant rate
        lo = (s * o.batch_size) % len(order)
        losses.append(train_step(module, obj, opt, params, [(order + order)[lo: lo + o.batch_size]],
                                 recipe.train.max_grad_norm))
    module.eval()
    return {"steps": steps, "chunks": base, "emphasis_chunks": len(obj.chunks) - base, "emphasis_found": found,
            "loss_first": losses[0], "loss_last": losses[-1]}


def load_anchor_lines(path: str | None) -> list[str]:
    """The lines of ``online.anchor_data`` (parsed when sampled); a missing or empty file is a clear error."""
    if not path:
        return []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"online.anchor_data {p}: no such file (a data stage's data/train.jsonl)")
    lines = [x for x in p.read_text().splitlines() if x.strip()]
    if not lines:
        raise ValueError(f"online.anchor_data {p}: empty file")
    return lines


def sample_anchors(lines: list[str], n: int, seed: int, tokenizer, max_tokens: int,
                   name: str) -> tuple[list[dict], dict]:
    """``n`` of ``lines`` (a seeded sample, file order) as {ids, mask}; corrupt rows are counted, not kept."""
    if not lines or n <= 0:
        return [], {}
    picks = np.random.default_rng(seed).choice(len(lines), size=min(n, len(lines)), replace=False)
    stats: Counter = Counter()
    out = []
    for i in sorted(picks.tolist()):
        s = sequence_from_line(lines[i], tokenizer, max_tokens, stats, where=f"{name}:{i + 1}")
        if s is not None:
            out.append({"ids": s["ids"], "mask": s["mask"]})
    return out, dict(stats)
