"""One ragged forward of many rows through the model's public forward, each row with its own length.

The rows live in one `draftsmith.engine.kvcache.KVCache` of many rows (gpt-fast style, indexed by absolute
slot). A forward over ``n`` live rows writes row i's ``m`` new entries at its own slots ``write[i], write[i] +
1, ...`` and attends over slots ``[0, span)`` of its rows, masked per row: rows with fewer committed tokens
carry no padding that grows with the steps, only the current block is padded to the widest row's block (a
chain of K or a tree's nodes), and slots past a row's own prefix are masked out.

Masks and positions go through the model's public forward (4D additive float mask [n, 1, m, span],
``position_ids`` [n, m]; per layer type where some layers slide, `draftsmith.engine.kvcache.window_masks`); the
model file is never copied. Live rows are kept at ``[0, n)``: when a row ends,
the last live row's entries are moved into the hole (`KVCache.move_row`, one row's copy).
"""

from __future__ import annotations

import torch

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.kvcache import KVCache, sliding_windows, window_masks


def ragged_forward(body: torch.nn.Module, cache: KVCache, ids: torch.Tensor, write: torch.Tensor,
                   pos: torch.Tensor, prefix: torch.Tensor, block: torch.Tensor, block_start: torch.Tensor,
                   rows: int | list[int] = 0) -> torch.Tensor:
    """One forward of ``n`` rows with ``m`` new entries each (padded): hidden states [n, m, d].

    Row i's entry j is written at slot ``write[i] + j`` with position ``pos[i, j]``; it sees the row's
    committed prefix, slots ``[0, prefix[i])``, and the slots ``block_start[i] + c`` where
    ``block[i, j, c]`` is True (its tree ancestors and itself); ``rows`` names the cache rows. Padding entries
    must see at least themselves; what they compute is never read, and their slots lie past the row's committed
    length (overwritten later).
    """
    n, m = ids.shape
    dev = ids.device
    slots = write[:, None] + torch.arange(m, device=dev)[None]
    kb = block.shape[-1]
    span = int(max(int((write + m).max()), int((block_start + kb).max()), int(prefix.max())))
    s = torch.arange(span, device=dev)
    allowed = (s[None, None, :] < prefix[:, None, None]).expand(n, m, span).clone()
    rel = s[None, :] - block_start[:, None]  # [n, span]
    inside = (rel >= 0) & (rel < kb)
    gathered = torch.gather(block, 2, rel.clamp(0, kb - 1)[:, None, :].expand(n, m, span))
    allowed |= gathered & inside[:, None, :]
    dtype = cache.layers[0].keys.dtype
    mask = torch.zeros((n, 1, m, span), dtype=dtype, device=dev)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    windows = sliding_windows(body.config)
    if windows:  # committed slots hold their positions (a tree's accepted path is compacted); block slots, pos
        kv_pos = s[None].expand(n, span).clone()
        kv_pos.scatter_(1, slots, pos)
        mask = window_masks(windows, mask, pos, kv_pos)
    cache.set_block(slots, span, rows)
    return body(input_ids=ids, position_ids=pos, attention_mask=mask, **cache_arg(body, cache),
                use_cache=True).last_hidden_state
