"""The ragged KV cache of `BatchGenerator` and its per-row attention for decode steps.

(`draftsmith.engine.ragged.RowsCache` is the batched speculative decoder's cache: same storage, but rows
write blocks of drafts at their own slots; this one writes prefill groups after a copied shared prefix and
one token per row. Folding the two into one class is open work.)

`RaggedCache` holds one pre-allocated row per sequence in flight, each with its own length, written
through the model's public forward: a prefill writes a group of rows from a slot (after a shared prefix
copied in), a decode step writes one entry per row at that row's own slot.

`row_attention(model, lengths)`: while the block runs, one-token attention reads each row's own entries
(one SDPA call per row) instead of one masked call over the longest row's span.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from draftsmith.engine.kvcache import kv_dims
from draftsmith.engine.ragged import SpanLayer

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


class _RaggedLayer(SpanLayer):

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        if o.mode == "prefill":
            # rows [r0, r0 + k), slots [offset, offset + width): the new entries; slots [0, offset) already
            # hold the shared prefix (copied in by `set_prefill`), so the context is slots [0, offset + width)
            r0, k, w, off = o.row0, key_states.shape[0], key_states.shape[-2], o.offset
            self.keys[r0:r0 + k, :, off:off + w] = key_states
            self.values[r0:r0 + k, :, off:off + w] = value_states
            if off == 0:
                return key_states, value_states
            return self.keys[r0:r0 + k, :, :off + w], self.values[r0:r0 + k, :, :off + w]
        # decode: one entry per row, at that row's own slot
        n = key_states.shape[0]
        self.keys[o.rows[:n], :, o.slots] = key_states[:, :, 0]
        self.values[o.rows[:n], :, o.slots] = value_states[:, :, 0]
        return self.keys[:n, :, :o.span], self.values[:n, :, :o.span]


class RaggedCache(Cache):
    """A pre-allocated KV cache of ``rows`` sequences, each with its own length.

    ``set_prefill(row0)``: the next forward writes rows [row0, row0 + k) from
    slot 0 (k and the width come from the forward's input). ``set_decode(slots,
    span)``: the next forward writes one entry per row n at ``slots[n]`` and
    attends over slots [0, span) of rows [0, n) (masked per row by the caller).

    ``zeroed=False`` leaves the buffers unset: only for callers whose attention reads written slots alone (the
    fused step's native kernel), where zeroing 2 x layers buffers (1.6 GB at 128 rows of 530 slots in bf16)
    cost 0.34 s a generator and touched every page whether used or not.
    """

    def __init__(self, config, rows: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
                 zeroed: bool = True):
        layers_n, n_kv, head_dim = kv_dims(config)
        shape = (int(rows), n_kv, int(capacity), head_dim)
        self.capacity, self.n_rows = int(capacity), int(rows)
        self.mode, self.row0, self.span, self.offset = "decode", 0, 0, 0
        self.rows = torch.arange(rows, device=device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        new = torch.zeros if zeroed else torch.empty
        layers = [_RaggedLayer(self, new(shape, dtype=dtype, device=device), new(shape, dtype=dtype, device=device))
                  for _ in range(layers_n)]
        super().__init__(layers=layers)

    @staticmethod
    def bytes_needed(config, rows: int, capacity: int, dtype: torch.dtype) -> int:
        """Memory of the cache: 2 (K, V) x layers x rows x kv_heads x capacity x head_dim x element size."""
        layers_n, n_kv, head_dim = kv_dims(config)
        el = torch.empty(0, dtype=dtype).element_size()
        return 2 * layers_n * rows * n_kv * capacity * head_dim * el

    def set_prefill(self, row0: int, k: int = 0, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    offset: int = 0) -> None:
        """The next forward writes rows [row0, row0 + k) from slot ``offset``; with ``offset > 0`` the first
        ``offset`` entries of ``prefix`` (per layer: keys, values [1, kv_heads, >= offset, head_dim]) are
        copied into those rows' slots [0, offset) first."""
        self.mode, self.row0, self.offset = "prefill", int(row0), int(offset)
        if offset:
            for layer, (pk, pv) in zip(self.layers, prefix):
                layer.keys[row0:row0 + k, :, :offset] = pk[:, :, :offset]
                layer.values[row0:row0 + k, :, :offset] = pv[:, :, :offset]

    def set_decode(self, slots: torch.Tensor, span: int) -> None:
        if span > self.capacity:
            raise RuntimeError(f"KV cache overflow: span {span} > capacity {self.capacity}")
        self.mode, self.slots, self.span = "decode", slots, int(span)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` entries onto row ``dst`` (compaction after a row ends)."""
        for layer in self.layers:
            layer.keys[dst, :, :length] = layer.keys[src, :, :length]
            layer.values[dst, :, :length] = layer.values[src, :, :length]
