"""Per-row attention for `BatchGenerator`'s decode steps through the model's own forward.

The generator's rows live in the stack's one cache (`draftsmith.engine.kvcache.KVCache`, one row per sequence in
flight): a prefill writes a group of rows from a slot after a shared prefix copied in (`KVCache.set_prefill`),
a decode step one entry per row at that row's own slot (`KVCache.set_decode`).

`row_attention(model, lengths)`: while the block runs, one-token attention reads each row's own entries
(one SDPA call per row) instead of one masked call over the longest row's span.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


# --- per-row attention for decode steps -----------------------------------------------------------------
# A decode step's single masked attention call reads every row's cache up to the longest live row's span.
# With rows of mixed lengths (ShareGPT prompts: median ~36 tokens, a few of 400+) most of what it reads is
# masked out, and reading the cache is what a one-token attention costs. `RAGGED_ATTENTION` is the name of
# an attention function that, while a `BatchGenerator` decode step runs, attends row by row over each row's
# own entries (one SDPA call per row, no mask: the row's slots [0, length] are exactly its causal past) and
# falls back to Hugging Face's SDPA otherwise. The generator switches the model's attention implementation
# to it only for that forward (`row_attention`). Another thread's forward on the same model meanwhile
# (the attention state is thread-local) gets plain SDPA and SDPA's masks: the name is registered for both.
RAGGED_ATTENTION = "draftsmith_ragged"
_ragged = threading.local()


def _ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    lens = getattr(_ragged, "lens", None)
    if lens is None or query.shape[2] != 1 or len(lens) != query.shape[0]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    n, heads, _, d = query.shape
    kv = key.shape[1]
    q = query.reshape(n, kv, heads // kv, d)  # one query token: GQA without repeating keys (pack_gqa)
    out = torch.empty_like(q)
    for i, length in enumerate(lens):
        out[i] = F.scaled_dot_product_attention(q[i:i + 1], key[i:i + 1, :, :length + 1],
                                                value[i:i + 1, :, :length + 1], scale=scaling)[0]
    return out.reshape(n, heads, 1, d).transpose(1, 2), None


AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)


@contextmanager
def row_attention(model: torch.nn.Module, lengths: list[int]):
    """While the block runs, ``model`` attends row by row (`_ragged_attention`) over ``lengths`` on this
    thread: row n's one query reads its slots [0, lengths[n]]."""
    cfg = model.config
    before = cfg._attn_implementation
    _ragged.lens = lengths
    cfg._attn_implementation = RAGGED_ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = before
        _ragged.lens = None
