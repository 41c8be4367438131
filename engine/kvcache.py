"""The one pre-allocated KV cache of the generation stack: rows of slots, indexed by absolute slot, usable
through a model's public forward.

gpt-fast style: one [rows, H_kv, capacity, D] buffer per layer and per K/V, allocated once. A single sequence
is one row (the single-sequence decoder, drafters with their own model); many sequences are many rows, each
with its own length (the batched decoder and the server, the data engine). Rejected draft entries are never
rolled back: they lie beyond the committed length and are overwritten by the next step.

A forward writes where the last ``set_*`` call said, in one of two shapes:
- a span (`set_write`, `set_prefill`): rows ``[row0, row0 + n)`` get their q new entries at the same slots
  ``[start, start + q)`` and attend over ``[0, start + q)``, so attention cost follows the live length, not the
  capacity (one sequence decoding; a group of prompts prefilled after a shared prefix copied in);
- per-row slots (`set_block`, `set_decode`): row ``rows[i]`` gets its entry j at ``slots[i, j]`` and attends
  over ``[0, span)``, masked per row by the caller (a batch's ragged drafts or decode tokens).
After a tree step, `compact_row` moves the accepted path's entries to consecutive slots; when a row ends, the
last live row's entries move into the hole (`move_row`).

It is a ``transformers.Cache`` subclass, so HF models take it as their cache argument (``cache``, or
``past_key_values`` in older transformers: callers pass ``**cache_arg(body, cache)`` from
`draftsmith.engine.cache_kw`); the attention mask is always passed explicitly as a 4D additive float mask (see
`additive_mask`), which HF hands to the attention kernel unchanged (eager adds it, sdpa passes it as
``attn_mask``). The compiled steps (`draftsmith.engine.fastpath`, `draftsmith.engine.fast_batch`) write the
layers' buffers themselves.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from draftsmith.target import sliding_windows  # noqa: F401 -- the engine's masks read it from here too


def kv_dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a causal LM's config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return int(cfg.num_hidden_layers), n_kv, head_dim


class _Layer(CacheLayerMixin):
    """One layer's key/value buffers of a `KVCache`, allocated up front; ``update`` writes where the owner says."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        if o.slots is None:  # a span: rows [row0, row0 + n), slots [start, start + q)
            r0, n, s = o.row0, key_states.shape[0], o.write_start
            e = s + key_states.shape[-2]
            if e > o.capacity:
                raise RuntimeError(f"KV cache overflow: writing slots [{s}, {e}) into capacity {o.capacity}")
            if r0 + n > o.n_rows:
                raise RuntimeError(f"KV cache has {o.n_rows} rows, a forward wrote rows up to {r0 + n}")
            self.keys[r0:r0 + n, :, s:e] = key_states
            self.values[r0:r0 + n, :, s:e] = value_states
            if s == 0 and o.fresh_at_zero:  # nothing before the new entries: attend over them as they came
                return key_states, value_states
            return self.keys[r0:r0 + n, :, :e], self.values[r0:r0 + n, :, :e]
        rows = o.row_idx[:, None]  # [n, 1]
        # advanced indices around a slice put their dims first: [n, m, H, D]
        self.keys[rows, :, o.slots] = key_states.transpose(1, 2)
        self.values[rows, :, o.slots] = value_states.transpose(1, 2)
        if o.contiguous is not None:  # live rows [r0, r0 + n): a view, no copy
            r0, r1 = o.contiguous
            return self.keys[r0:r1, :, :o.span], self.values[r0:r1, :, :o.span]
        return self.keys[o.row_idx, :, :o.span], self.values[o.row_idx, :, :o.span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        o = self.owner
        return (o.write_start + query_length if o.slots is None else o.span), 0

    def get_seq_length(self) -> int:
        o = self.owner
        return o.write_start if o.slots is None else o.span

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def reset(self) -> None:
        pass


class KVCache(Cache):
    """Pre-allocated KV cache of ``rows`` sequences of up to ``capacity`` entries each (see the module docstring).

    ``zeroed=False`` leaves the buffers unset: only for callers whose attention reads written slots alone (the
    data engine's fused step and its native kernel), where zeroing 2 x layers buffers (1.6 GB at 128 rows of 530
    slots in bf16) cost 0.34 s a generator and touched every page whether used or not.
    """

    def __init__(self, config, capacity: int, dtype: torch.dtype, device: torch.device | str, rows: int = 1,
                 zeroed: bool = True):
        layers_n, n_kv, head_dim = kv_dims(config)
        shape = (int(rows), n_kv, int(capacity), head_dim)
        self.capacity, self.n_rows = int(capacity), int(rows)
        self.zeroed = bool(zeroed)  # False: unset buffers, for attention that reads written slots only
        self.rows = torch.arange(rows, device=device)
        # where the next forward writes: a span (slots None) or per-row slots
        self.write_start, self.row0, self.fresh_at_zero = 0, 0, False
        self.slots: torch.Tensor | None = None
        self.row_idx, self.contiguous, self.span = self.rows[:0], None, 0
        new = torch.zeros if zeroed else torch.empty
        layers = [_Layer(self, new(shape, dtype=dtype, device=device), new(shape, dtype=dtype, device=device))
                  for _ in range(layers_n)]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int, rows: int = 1, zeroed: bool = True) -> "KVCache":
        p = next(model.parameters())
        return cls(model.config, capacity, p.dtype, p.device, rows=rows, zeroed=zeroed)

    @staticmethod
    def bytes_needed(config, rows: int, capacity: int, dtype: torch.dtype) -> int:
        """Memory of the cache: 2 (K, V) x layers x rows x kv_heads x capacity x head_dim x element size."""
        layers_n, n_kv, head_dim = kv_dims(config)
        el = torch.empty(0, dtype=dtype).element_size()
        return 2 * layers_n * rows * n_kv * capacity * head_dim * el

    # where the next forward writes ----------------------------------------------------------------------
    def set_write(self, start: int) -> "KVCache":
        """The next forward writes its q entries at slots [start, start + q) of row 0 (of rows [0, n) for a
        forward of n sequences) and attends to [0, start + q)."""
        if start < 0 or start > self.capacity:
            raise ValueError(f"write start {start} outside the cache capacity {self.capacity}")
        self.write_start, self.row0, self.fresh_at_zero, self.slots = int(start), 0, False, None
        return self

    def set_prefill(self, row0: int, k: int = 0, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    offset: int = 0) -> None:
        """The next forward writes rows [row0, row0 + k) from slot ``offset``; with ``offset > 0`` the first
        ``offset`` entries of ``prefix`` (per layer: keys, values [1, kv_heads, >= offset, head_dim]) are
        copied into those rows' slots [0, offset) first."""
        self.write_start, self.row0, self.fresh_at_zero, self.slots = int(offset), int(row0), True, None
        if offset:
            self.put_prefix(slice(row0, row0 + k), prefix, offset)

    def put_prefix(self, rows: slice | torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]],
                   offset: int) -> None:
        """Copy the first ``offset`` entries of ``prefix`` (per layer: keys, values [1, kv_heads, >= offset,
        head_dim]) into slots [0, offset) of ``rows`` (a slice or an index tensor)."""
        for layer, (pk, pv) in zip(self.layers, prefix):
            layer.keys[rows, :, :offset] = pk[:, :, :offset]
            layer.values[rows, :, :offset] = pv[:, :, :offset]

    def get_prefix(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row ``row``'s first ``length`` entries, per layer (keys, values [1, kv_heads, length,
        head_dim]): what `put_prefix` copies into other rows."""
        return [(layer.keys[row:row + 1, :, :length].clone(), layer.values[row:row + 1, :, :length].clone())
                for layer in self.layers]

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

    def set_decode(self, slots: torch.Tensor, span: int) -> None:
        """The next forward writes one entry per row n (rows [0, n)) at ``slots[n]`` and attends over slots
        [0, span), masked per row by the caller."""
        self.set_block(slots[:, None], span, 0)

    # moving entries ---------------------------------------------------------------------------------------
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` entries onto row ``dst`` (a finished row's hole is filled)."""
        for layer in self.layers:
            layer.keys[dst, :, :length] = layer.keys[src, :, :length]
            layer.values[dst, :, :length] = layer.values[src, :, :length]

    def compact_row(self, row: int, src_slots: list[int], dst_start: int) -> None:
        """Move row ``row``'s entries at ``src_slots`` to consecutive slots from ``dst_start`` (a tree's accepted
        path). Reading through an index tensor makes a copy first, so overlapping source and destination ranges
        are safe. A no-op when they are already there (chains)."""
        n = len(src_slots)
        if n == 0 or list(src_slots) == list(range(dst_start, dst_start + n)):
            return
        idx = torch.tensor(src_slots, dtype=torch.long, device=self.rows.device)
        for layer in self.layers:
            layer.keys[row, :, dst_start:dst_start + n] = layer.keys[row, :, idx]
            layer.values[row, :, dst_start:dst_start + n] = layer.values[row, :, idx]

    def compact(self, src_slots: list[int], dst_start: int) -> None:
        """`compact_row` for a single sequence (row 0)."""
        self.compact_row(0, src_slots, dst_start)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[q, kv] bool (True = may attend) -> [1, 1, q, kv] additive float mask (0 or dtype min).

    A float mask works for both HF attention paths: eager adds the mask to
    the scores (a bool mask would be added as 0/1 and silently ignored),
    sdpa passes it through as ``attn_mask``. Checked in tests/test_trees.py.
    """
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m[None, None]


def prefix_block_mask(prefix_len: int, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mask for a block of q new entries at slots [prefix_len, prefix_len + kv_block).

    Every row sees the whole committed prefix [0, prefix_len); ``block`` [q, kv_block]
    bool says which block slots each row sees (its tree ancestors and itself).
    """
    q, kb = block.shape
    allowed = torch.ones((q, prefix_len + kb), dtype=torch.bool, device=block.device)
    allowed[:, prefix_len:] = block
    return additive_mask(allowed, dtype)


def window_masks(windows: dict[str, int], mask: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor):
    """An explicit additive mask [n, 1, q, kv] as the model's forward wants it when some layers slide: the model
    uses an explicit 4D mask as it is, for every layer, so a sliding layer would see past its window. ``q_pos``
    [n or 1, q] and ``kv_pos`` [n or 1, kv] are the positions of the queries and of the cache slots; returns
    ``mask`` itself (no window), the windowed mask (every layer slides), or ``{"full_attention": mask,
    "sliding_attention": windowed}`` (per layer type, the dict those models take)."""
    if not windows:
        return mask
    w = next(iter(windows.values()))
    far = (q_pos[:, :, None] - kv_pos[:, None, :]) >= w  # [n, q, kv]
    slid = mask.masked_fill(far[:, None], torch.finfo(mask.dtype).min)
    return slid if "all" in windows else {"full_attention": mask, "sliding_attention": slid}

