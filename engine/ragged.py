"""A pre-allocated KV cache of many rows, each with its own length, and one ragged forward through it.

The batched counterpart of `kvcache.SlotCache` (gpt-fast style, indexed by
absolute slot): one [rows, H_kv, capacity, D] buffer per layer and per K/V,
allocated once. A forward over ``n`` live rows writes row i's ``m`` new
entries at its own slots ``write[i], write[i] + 1, ...`` and attends over
slots ``[0, span)`` of its rows, masked per row: rows with
fewer committed tokens carry no padding that grows with the steps, only the
current block is padded to the widest row's block (a chain of K or a tree's
nodes), and slots past a row's own prefix are masked out.

Masks and positions go through the model's public forward (4D additive
float mask [n, 1, m, span], ``position_ids`` [n, m]); the model file is
never copied. Live rows are kept at ``[0, n)``: when a row ends, the last
live row's entries are moved into the hole (`move_row`, one row's copy).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.kvcache import PreallocatedLayer, kv_dims


class SpanLayer(PreallocatedLayer):
    """A layer of a many-row cache whose owner attends over slots [0, ``owner.span``) of each row."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        return self.owner.span

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def reset(self) -> None:
        pass


class _RowsLayer(SpanLayer):

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        rows = o.row_idx[:, None]  # [n, 1]
        # advanced indices around a slice put their dims first: [n, m, H, D]
        self.keys[rows, :, o.slots] = key_states.transpose(1, 2)
        self.values[rows, :, o.slots] = value_states.transpose(1, 2)
        if o.contiguous is not None:  # live rows [r0, r0 + n): a view, no copy
            r0, r1 = o.contiguous
            return self.keys[r0:r1, :, :o.span], self.values[r0:r1, :, :o.span]
        return self.keys[o.row_idx, :, :o.span], self.values[o.row_idx, :, :o.span]


class RowsCache(Cache):
    """Pre-allocated KV cache of ``rows`` sequences of up to ``capacity`` entries each (see the module docstring)."""

    def __init__(self, config, rows: int, capacity: int, dtype: torch.dtype, device: torch.device | str):
        layers_n, n_kv, head_dim = kv_dims(config)
        shape = (int(rows), n_kv, int(capacity), head_dim)
        self.capacity, self.n_rows = int(capacity), int(rows)
        self.span, self.contiguous = 0, None
        self.rows = torch.arange(rows, device=device)
        self.row_idx = self.rows[:0]
        self.slots = torch.zeros((0, 0), dtype=torch.long, device=device)
        layers = [_RowsLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                             torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(layers_n)]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model: torch.nn.Module, rows: int, capacity: int) -> "RowsCache":
        p = next(model.parameters())
        return cls(model.config, rows, capacity, p.dtype, p.device)

    def set_block(self, slots: torch.Tensor, span: int, rows: int | list[int] = 0) -> None:
        """The next forward writes the entry j of its i-th row at ``slots[i, j]`` of cache row ``rows[i]``
        (an int: rows ``rows, rows + 1, ...``) and attends over slots [0, span)."""
        n = slots.shape[0]
        if span > self.capacity:
            raise RuntimeError(f"KV cache overflow: span {span} > capacity {self.capacity}")
        if isinstance(rows, int):
            if rows + n > self.n_rows:
                raise RuntimeError(f"KV cache has {self.n_rows} rows, a forward asked for rows up to {rows + n}")
            self.row_idx, self.contiguous = self.rows[rows:rows + n], (rows, rows + n)
        else:
            self.row_idx, self.contiguous = torch.tensor(rows, dtype=torch.long, device=self.rows.device), None
            if list(rows) == list(range(rows[0], rows[0] + n)):
                self.contiguous = (rows[0], rows[0] + n)
        self.slots, self.span = slots, int(span)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` entries onto row ``dst`` (a finished row's hole is filled)."""
        for layer in self.layers:
            layer.keys[dst, :, :length] = layer.keys[src, :, :length]
            layer.values[dst, :, :length] = layer.values[src, :, :length]

    def compact_row(self, row: int, src_slots: list[int], dst_start: int) -> None:
        """Move row ``row``'s entries at ``src_slots`` to consecutive slots from ``dst_start`` (a tree's accepted
        path); a no-op when they are already there (chains)."""
        n = len(src_slots)
        if n == 0 or list(src_slots) == list(range(dst_start, dst_start + n)):
            return
        idx = torch.tensor(src_slots, dtype=torch.long, device=self.rows.device)
        for layer in self.layers:
            layer.keys[row, :, dst_start:dst_start + n] = layer.keys[row, :, idx]
            layer.values[row, :, dst_start:dst_start + n] = layer.values[row, :, idx]


def ragged_forward(body: torch.nn.Module, cache: RowsCache, ids: torch.Tensor, write: torch.Tensor,
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
    cache.set_block(slots, span, rows)
    return body(input_ids=ids, position_ids=pos, attention_mask=mask, **cache_arg(body, cache),
                use_cache=True).last_hidden_state
