"""Training chunks and the calibration split, shared by every kind that trains on the cache."""

from __future__ import annotations

import numpy as np

from draftsmith.common.hidden_cache import HiddenCache


def calibration_split(n: int, every: int) -> set[int]:
    """Sequences held out of training to measure acceptance for tree building: every ``every``-th one."""
    return set(range(every - 1, n, every)) if every > 0 else set()


def make_chunks(cache: HiddenCache, chunk_len: int, min_offset: int = 2,
                exclude: set[int] | None = None) -> list[tuple[int, int, int]]:
    """(sequence, lo, hi) windows that contain at least one head-1 label."""
    chunks = []
    for i in range(len(cache)):
        if exclude and i in exclude:
            continue
        m = cache.mask(i)
        n = len(m)
        # position t has a head-1 label if mask[t + 2]
        has = np.zeros(n, dtype=bool)
        if n > min_offset:
            has[: n - min_offset] = m[min_offset:] > 0
        for lo in range(0, n, chunk_len):
            if has[lo: lo + chunk_len].any():
                chunks.append((i, lo, min(lo + chunk_len, n)))
    return chunks
