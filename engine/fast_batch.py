"""A continuous-batching decode step for Llama-family targets: one token per row, each row at its own length,
compiled once for every batch size.

The data engine (`draftsmith.train.data.batchgen.BatchGenerator`) keeps one pre-allocated cache row per sequence in
flight. Its decode step through the model's own forward pays, per step, Hugging Face's Python work for 30
layers, unfused and unpacked weights, a 4D mask and padded (or per-row) attention. `FastBatchBody` is the same
step as one function over the same cache tensors, `draftsmith.engine.fastpath`'s way:

  * the weights fused (q/k/v in one matrix, gate/up in one) and, compiled, frozen into the graph so that
    inductor packs them once for oneDNN/MKL;
  * each row's new key and value written at its own slot inside the graph; attention by
    `draftsmith.engine.native.ragged_decode_attention` (an opaque custom op: the native kernel reads each
    row's own entries only), so the graph depends on no row's length;
  * the batch size, the cache's rows and its capacity marked dynamic: one compiled graph serves the full batch,
    the draining tail of a run and a generator of another size (a 1-row step runs as 2 rows, since a size of
    1 is one that compilers specialise on; a 1-row cache runs eagerly);
  * the LM head inside the graph;
  * prefills too run fused, eagerly: the admitted prompts as one flat run of tokens (no padding), each token
    written at its own row and slot, attention by one SDPA call per prompt (`ragged_prefill_attention`).

Rotary cos/sin come from the model's own rotary module, computed eagerly (as in `fastpath`). The result
differs from the model's forward only in the order of floating-point accumulation (tests/test_fast_batch.py
compares the two, and runs the data engine's greedy-equality tests through both).
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
import torch._dynamo

from draftsmith.engine.fastpath import MODES, _Core, frozen_weights, unsupported
from draftsmith.engine.native import native_for, ragged_decode_attention, ragged_prefill_attention

log = logging.getLogger(__name__)


class _BatchCore(_Core):
    """`fastpath`'s fused weights, computing one token for each of b rows."""

    attend = staticmethod(ragged_decode_attention)  # `FastBatchBody` swaps in the native kernel where it applies

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                kv: list[torch.Tensor], logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [b]: each row's token; cos, sin [b, 1, head_dim] at each row's position; slots [b]: where row r's
        key and value go in cache row r (its length so far), and the last slot it attends to; kv: the cache's
        key and value buffers [rows >= b, kv_heads, capacity, head_dim], layer by layer."""
        rows = torch.arange(ids.shape[0], device=ids.device)
        h = self.layers(ids, cos, sin, rows, slots, kv, lambda q, k, v: self.attend(q, k, v, slots, self.scale))
        return h, self.lin(h, self.head_w) if logits else None

    def prefill(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor, kv: list[torch.Tensor], group: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts as one flat run of T tokens (no padding): token t is ids[t] at position slots[t] of cache row
        rows[t]; ``group`` = (cache row, start in the run, first slot) of each prompt (`ragged_prefill_attention`).
        Returns the final states [T, hidden] and the logits of the tokens at ``last`` (each prompt's last)."""
        g_rows, starts, offs = group
        h = self.layers(ids, cos, sin, rows, slots, kv,
                        lambda q, k, v: ragged_prefill_attention(q, k, v, g_rows, starts, offs, self.scale))
        return h, self.lin(h[last], self.head_w)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def layers(self, ids, cos, sin, rows, slots, kv, attend) -> torch.Tensor:
        """Every layer over the tokens ``ids`` [T] (token t at slot slots[t] of cache row rows[t]: its key and value
        are written there before ``attend(q, k_cache, v_cache)`` runs), then the final norm."""
        t = ids.shape[0]
        h = self.embed(ids)
        nh, nk, d = self.n_heads, self.n_kv, self.head_dim
        for i in range(len(self.qkv)):
            qs, ks, vs = self.qkv_in(i, h)
            qs = self.rotate(qs.view(t, nh, d), cos, sin)
            ks = self.rotate(ks.view(t, nk, d), cos, sin)
            kc, vc = kv[2 * i], kv[2 * i + 1]
            kc[rows, :, slots] = ks
            vc[rows, :, slots] = vs.view(t, nk, d)
            h = self.layer_out(i, h, attend(qs, kc, vc).reshape(t, nh * d))
        return self._rms(h, self.norm_w)


class FastBatchBody:
    """The decode step of `BatchGenerator` as one function (see the module docstring).

    Args:
      model: a Llama-family causal LM (`fastpath.unsupported` is None for it); its weights are copied fused.
      compile: compile with inductor, weights frozen, batch and cache sizes dynamic; False runs the same
        function eagerly.
    """

    def __init__(self, model, compile: bool = True):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the fast batched decode step does not support this model: {why}")
        self.core = _BatchCore(model)
        p = self.core.norm_w
        op = native_for(p.dtype, p.device, self.core.head_dim)  # the data engine's caches have contiguous slots
        if op is not None:
            self.core.attend = op
        self.native = op is not None
        self.compiled = None
        self.compile_s = 0.0  # seconds spent in calls that compiled
        self.compiles = 0
        if compile:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.compiled = torch.compile(self.core, dynamic=False, options={"emulate_precision_casts": True})

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.core.rotary(self.core.norm_w, pos[None])
        return cos[0][:, None], sin[0][:, None]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, slots: torch.Tensor, kv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: row r (of ids' b) is fed ids[r] at position slots[r] (written there in cache row r,
        attending to [0, slots[r]]). Returns the final states [b, hidden] (after the final norm) and logits.
        Cache rows past b must be free (a 1-row step may use row 1 as padding)."""
        b = ids.shape[0]
        if b == 1 and self.compiled is not None and kv[0].shape[0] > 1:
            # a graph traced at 1 row would be a second compile (1 is specialised): run 2 rows, the second a
            # free cache row (rows are live at [0, n)) written at slot 0, which its next prefill overwrites
            h, lg = self.step(torch.cat([ids, ids]), torch.cat([slots, slots.new_zeros(1)]), kv)
            return h[:1], lg[:1]
        cos, sin = self.rope(slots)
        if self.compiled is None or b == 1:
            return self.core(ids, cos, sin, slots, kv)
        for t in (ids, slots, cos, sin):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in kv:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        t0 = time.perf_counter()
        before = _frames_compiled()
        with frozen_weights():
            out = self.compiled(ids, cos, sin, slots, kv)
        if _frames_compiled() != before:
            dt = time.perf_counter() - t0
            self.compile_s += dt
            self.compiles += 1
            log.info("compiled the batched decode step (%d rows, %d-slot cache) in %.1f s", ids.shape[0],
                     kv[0].shape[2], dt)
        return out

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], rows: list[int], offset: int, kv: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Prefill ``prompts[g][offset:]`` into cache row ``rows[g]`` from slot ``offset`` (slots before it already
        hold a shared prefix), all prompts in one flat forward, eagerly (its large products gain little from
        compiling, and a second graph would cost a compile). Returns the final states [T, hidden] of the run, the
        logits of each prompt's last token [g, vocab], and where each prompt starts in the run (plus T)."""
        dev = kv[0].device
        starts = [0]
        for p in prompts:
            starts.append(starts[-1] + len(p) - offset)
        ids = torch.tensor([t for p in prompts for t in p[offset:]], device=dev)
        tok_rows = torch.tensor([r for r, p in zip(rows, prompts) for _ in range(len(p) - offset)], device=dev)
        slots = torch.tensor([offset + j for p in prompts for j in range(len(p) - offset)], device=dev)
        cos, sin = self.rope(slots)
        st = torch.tensor(starts, device=dev)
        group = (torch.tensor(rows, device=dev), st, torch.full((len(prompts),), offset, device=dev))
        h, logits = self.core.prefill(ids, cos, sin, tok_rows, slots, kv, group, st[1:] - 1)
        return h, logits, starts


def _frames_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


_bodies: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, FastBatchBody]]" = weakref.WeakKeyDictionary()


def batch_body(model, mode: str = "compile") -> FastBatchBody | None:
    """The `FastBatchBody` every `BatchGenerator` on ``model`` shares for ``mode`` ("compile" or "fast"), built on
    first use (its compiled graph then serves every later generator: Magpie prompts, answers, held-out
    answers); None for "eager" or a model it does not support (logged: the model's own forward is used)."""
    if mode not in MODES:
        raise ValueError(f"decoding forward must be one of {MODES}, got {mode!r}")
    if mode == "eager":
        return None
    why = unsupported(model)
    if why is not None:
        log.warning("the fast batched decode step does not support this model (%s): using its own forward", why)
        return None
    per = _bodies.setdefault(model, {})
    if mode not in per:
        per[mode] = FastBatchBody(model, compile=mode == "compile")
    return per[mode]
