"""A pre-allocated KV cache indexed by absolute slot, usable through a model's public forward.

gpt-fast style: one [B, H_kv, capacity, D] buffer per layer and per K/V is
allocated once. A forward writes its new keys and values at slots
``[write_start, write_start + q)`` (``set_write`` before calling the model)
and attends over slots ``[0, write_start + q)``, so attention cost follows
the live length, not the capacity. Rejected draft entries are never rolled
back: they lie beyond the committed length and are overwritten by the next
step. After a tree step, `compact` moves the accepted path's entries to
consecutive slots.

It is a ``transformers.Cache`` subclass, so HF models take it as their cache
argument (``cache``, or ``past_key_values`` in older transformers: callers pass
``**cache_arg(body, cache)`` from `draftsmith.engine.cache_kw`); the attention
mask is always passed explicitly as a 4D additive float mask (see
`additive_mask`), which HF hands to the attention kernel unchanged (eager adds
it, sdpa passes it as ``attn_mask``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def kv_dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a causal LM's config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return int(cfg.num_hidden_layers), n_kv, head_dim


class PreallocatedLayer(CacheLayerMixin):
    """A cache layer over key/value tensors allocated up front; subclasses say where ``update`` writes."""

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


class _SlotLayer(PreallocatedLayer):

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        s = self.owner.write_start
        e = s + key_states.shape[-2]
        if e > self.keys.shape[-2]:
            raise RuntimeError(f"KV cache overflow: writing slots [{s}, {e}) into capacity {self.keys.shape[-2]}")
        self.keys[:, :, s:e] = key_states
        self.values[:, :, s:e] = value_states
        return self.keys[:, :, :e], self.values[:, :, :e]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.write_start + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.write_start

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def reset(self) -> None:
        pass


class SlotCache(Cache):
    """Pre-allocated KV cache for one causal LM (batch size 1)."""

    def __init__(self, config, capacity: int, dtype: torch.dtype, device: torch.device | str, batch_size: int = 1):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        shape = (batch_size, n_kv, int(capacity), head_dim)
        self.capacity = int(capacity)
        self.write_start = 0
        layers = [_SlotLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                             torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(int(cfg.num_hidden_layers))]
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity: int) -> "SlotCache":
        p = next(model.parameters())
        return cls(model.config, capacity, p.dtype, p.device)

    def set_write(self, start: int) -> "SlotCache":
        """The next forward writes at slots [start, start + q) and attends to [0, start + q)."""
        if start < 0 or start > self.capacity:
            raise ValueError(f"write start {start} outside the cache capacity {self.capacity}")
        self.write_start = int(start)
        return self

    def compact(self, src_slots: list[int], dst_start: int) -> None:
        """Move the entries at ``src_slots`` to slots ``dst_start, dst_start + 1, ...``.

        Reading through an index tensor makes a copy first, so overlapping
        source and destination ranges are safe. A no-op for chains, whose
        accepted entries already sit at consecutive slots.
        """
        n = len(src_slots)
        if n == 0 or list(src_slots) == list(range(dst_start, dst_start + n)):
            return
        dev = self.layers[0].keys.device
        idx = torch.tensor(src_slots, dtype=torch.long, device=dev)
        for layer in self.layers:
            layer.keys[:, :, dst_start:dst_start + n] = layer.keys[:, :, idx]
            layer.values[:, :, dst_start:dst_start + n] = layer.values[:, :, idx]


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
