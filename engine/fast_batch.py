"""The batched entry points of the one ragged step (`draftsmith.engine.fastpath._Core.forward`): a
continuous-batching decode step (one token per row, each row at its own length, compiled once for every batch
size), prefills, and the verification of every row's draft block.

The data engine (`draftsmith.train.data.batchgen.BatchGenerator`) and the batched decoder (the server's) keep one
pre-allocated cache row per sequence in flight. A step through the model's own forward pays, per step, Hugging
Face's Python work for 30 layers, unfused and unpacked weights, a 4D mask and padded (or per-row) attention.
`FastBatchBody` runs the same step as the single-sequence decoder's `FastBody` does, over the same cache tensors:

  * the weights fused (q/k/v in one matrix, gate/up in one) and, compiled, frozen into the graph so that
    inductor packs them once for oneDNN/MKL;
  * each token's new key and value written at its own row and slot inside the step; decode attention by
    `draftsmith.engine.native.ragged_decode_attention` (an opaque custom op: the native kernel reads each
    row's own entries only), so the graph depends on no row's length;
  * the batch size, the cache's rows and its capacity marked dynamic: one compiled graph serves the full batch,
    the draining tail of a run and a generator of another size (a 1-row step runs as 2 rows, since a size of
    1 is one that compilers specialise on; a 1-row cache runs eagerly);
  * the LM head inside the graph;
  * prefills too run fused, eagerly: the admitted prompts as one flat run of tokens (no padding), each token
    written at its own row and slot, attention by one SDPA call per prompt (`ragged_prefill_attention`);
  * `verify`: every row's chain or tree block as one flat run, eagerly, each block attending to its own cache
    row by the native block kernel (`ragged_block_attention`); the layers' forward hooks are called with their
    outputs, for a drafter that reads them (EAGLE-3).

Rotary cos/sin come from the model's own rotary module, computed eagerly (as in `fastpath`). The result
differs from the model's forward only in the order of floating-point accumulation (tests/test_fast_batch.py
compares the two, and runs the data engine's greedy-equality tests through both; tests/test_batched.py runs
every drafter family's batched decoding through it)."""

from __future__ import annotations

import logging
import time
import weakref

import torch
import torch._dynamo

from draftsmith.engine.fastpath import (MODES, _Core, allow_graphs, call_layer_hooks, frozen_weights, hooked_layers,
                                       shared_core, unsupported)
from draftsmith.engine.kvcache import sliding_windows
from draftsmith.engine.native import ROWS_LINEAR_MAX, native_for

log = logging.getLogger(__name__)


class FastBatchBody:
    """The batched step of the data engine (`BatchGenerator`) and the batched decoder: decode steps, prefills and
    verification through the one ragged step (see the module docstring).

    Args:
      model: a Llama-family causal LM (`fastpath.unsupported` is None for it); its weights are copied fused.
      compile: compile with inductor, weights frozen, batch and cache sizes dynamic; False runs the same
        function eagerly.
      core: the fused weights to run on (the single-sequence `FastBody`'s, `fastpath.shared_core`: one copy of
        the weights for both); None: copied from ``model``.
      pack: steps of up to 16 rows multiply from exact 4/8-bit copies of the weights where they exist, with
        the same bits (`fastpath._Core.pack_weights`).
      within_window: the caller keeps every row within the target's sliding windows (the data engine refuses a
        job past them), where a sliding layer attends as a full one does; without it a target with sliding
        windows is refused (`unsupported_rows`).
    """

    def __init__(self, model, compile: bool = True, core: _Core | None = None, pack: bool = True,
                 within_window: bool = False):
        why = unsupported_rows(model, within_window)
        if why is not None:
            raise ValueError(f"the fast batched decode step does not support this model: {why}")
        self.core = core if core is not None else _Core(model)
        if pack:
            self.core.pack_weights()
        self.core.place_on_huge_pages()
        self._layers = list(model.get_decoder().layers)  # for their forward hooks (`verify`, `prefill`)
        p = self.core.norm_w
        op = native_for(p.dtype, p.device, self.core.head_dim)  # the data engine's caches have contiguous slots
        if op is not None:
            self.core.attend_rows = op
        self.native = op is not None
        self.compiled = None
        self.compile_s = 0.0  # seconds spent in calls that compiled
        self.compiles = 0
        if compile:
            allow_graphs()
            self.compiled = torch.compile(self.core, dynamic=False, options={"emulate_precision_casts": True})

    def hooked(self) -> bool:
        """Whether any of the model's layers carries a forward hook (a drafter reading its outputs): then a
        drafting decoder's steps go through `verify`, which calls them, and not the compiled `step`."""
        return bool(hooked_layers(self._layers))

    def graph_rows(self, max_rows: int) -> list[int]:
        """Row counts up to ``max_rows`` whose compiled steps are graphs of their own, one for each: 2 (a step of up to
        `ROWS_LINEAR_MAX` rows multiplies by the native kernels) and, where the core multiplies by them, the first
        count past it (the BLAS products). A server compiles them all before its first request: measured on the
        2-core AVX2 EPYC, the 32-row graph compiled in the middle of a burst of 32 requests for 73-83 s."""
        sizes = [min(2, max_rows)]
        if self.compiled is not None and self.core.rows_native and max_rows > ROWS_LINEAR_MAX:
            sizes.append(ROWS_LINEAR_MAX + 1)
        return sizes

    @torch.no_grad()
    def step(self, ids: torch.Tensor, slots: torch.Tensor, kv: list[torch.Tensor], eager_rows: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: row r (of ids' b) is fed ids[r] at position slots[r] (written there in cache row r,
        attending to [0, slots[r]]). Returns the final states [b, hidden] (after the final norm) and logits.
        Cache rows past b must be free (a 1-row step may use row 1 as padding). ``eager_rows``: a step of at most
        this many rows runs the same function eagerly (the data engine's drain, `BatchGenerator.eager_rows`)."""
        b = ids.shape[0]
        if b <= eager_rows:
            cos, sin = self.core.rope(slots)
            return self.core(ids, cos, sin, torch.arange(b, device=ids.device), slots, kv, "rows", (slots,))[:2]
        if b == 1 and self.compiled is not None and kv[0].shape[0] > 1:
            # a graph traced at 1 row would be a second compile (1 is specialised): run 2 rows, the second a
            # free cache row (rows are live at [0, n)) written at slot 0, which its next prefill overwrites
            h, lg = self.step(torch.cat([ids, ids]), torch.cat([slots, slots.new_zeros(1)]), kv)
            return h[:1], lg[:1]
        cos, sin = self.core.rope(slots)
        rows = torch.arange(b, device=ids.device)
        if self.compiled is None or b == 1:
            return self.core(ids, cos, sin, rows, slots, kv, "rows", (slots,))[:2]
        for t in (ids, rows, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        self.core.mark_rope_dynamic(cos, sin)
        for t in kv:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        t0 = time.perf_counter()
        before = _frames_compiled()
        with frozen_weights():
            out = self.compiled(ids, cos, sin, rows, slots, kv, "rows", (slots,))[:2]
        if _frames_compiled() != before:
            dt = time.perf_counter() - t0
            self.compile_s += dt
            self.compiles += 1
            log.info("compiled the batched decode step (%d rows, %d-slot cache) in %.1f s", ids.shape[0],
                     kv[0].shape[2], dt)
        return out

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], rows: list[int], offset: int, kv: list[torch.Tensor],
                hooks: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Prefill ``prompts[g][offset:]`` into cache row ``rows[g]`` from slot ``offset`` (slots before it already
        hold a shared prefix), all prompts in one flat forward, eagerly (its large products gain little from
        compiling, and a second graph would cost a compile). Returns the final states [T, hidden] of the run, the
        logits of each prompt's last token [g, vocab], and where each prompt starts in the run (plus T).
        ``hooks``: call the forward hooks on the model's layers with their outputs ([1, T, hidden]; one prompt)."""
        if hooks and len(prompts) != 1:
            raise ValueError("a prefill that calls the layers' hooks takes one prompt (the hooks see one sequence)")
        dev = kv[0].device
        starts = [0]
        for p in prompts:
            starts.append(starts[-1] + len(p) - offset)
        ids = torch.tensor([t for p in prompts for t in p[offset:]], device=dev)
        tok_rows = torch.tensor([r for r, p in zip(rows, prompts) for _ in range(len(p) - offset)], device=dev)
        slots = torch.tensor([offset + j for p in prompts for j in range(len(p) - offset)], device=dev)
        st = torch.tensor(starts, device=dev)
        group = (torch.tensor(rows, device=dev), st, torch.full((len(prompts),), offset, device=dev))
        taps = hooked_layers(self._layers) if hooks else ()
        h, logits, outs = self.core(ids, *self.core.rope(slots), tok_rows, slots, kv, "prefill", group,
                                    logits=st[1:] - 1, taps=taps)
        call_layer_hooks(self._layers, taps, tuple(o[None] for o in outs))
        return h, logits, starts

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, allow: torch.Tensor,
               counts: list[int], kv: list[torch.Tensor], hooks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative blocks of n rows in one forward (a batched verification): row r's first ``counts[r]``
        tokens of ``ids[r]`` ([n, m]) at positions ``pos[r]``, written at slots ``start[r]``, ``start[r] + 1``, ...
        of cache row r, token j seeing the row's slots before ``start[r]`` and block token i where ``allow[r, j,
        i]`` ([n, m, m] bool). The blocks run as one flat run without padding (a row with no draft is one token).
        Returns the final states [n, m, hidden] (zero past a row's count) and the logits of the flat run [sum of
        counts, vocab], row after row. ``hooks``: call the forward hooks on the model's layers with their outputs,
        laid out [n, m, hidden] as the states."""
        n, m = ids.shape
        dev = ids.device
        c = torch.tensor(counts, device=dev)
        live = torch.arange(m, device=dev)[None] < c[:, None]  # [n, m]: the real tokens
        rows = torch.arange(n, device=dev)
        starts = torch.zeros(n + 1, dtype=torch.long, device=dev)
        starts[1:] = c.cumsum(0)
        slots = (start[:, None] + torch.arange(m, device=dev))[live]
        taps = hooked_layers(self._layers) if hooks else ()
        h, lg, outs = self.core(ids[live], *self.core.rope(pos[live]), rows.repeat_interleave(c), slots, kv, "blocks",
                                (rows, starts, slots, allow), taps=taps)

        def pad(x: torch.Tensor) -> torch.Tensor:
            full = x.new_zeros(n, m, x.shape[-1])
            full[live] = x
            return full

        call_layer_hooks(self._layers, taps, tuple(pad(o) for o in outs))
        return pad(h), lg


def unsupported_rows(model, within_window: bool = False) -> str | None:
    """Why `FastBatchBody` cannot run ``model`` (None when it can): what `fastpath.unsupported` names, and sliding
    windows (Gemma 3's sliding layers) unless the caller keeps every row within them (``within_window``): its
    ragged kernels attend over every live slot of a row, so the batched decoder keeps the model's own forward,
    which applies the windows."""
    why = unsupported(model)
    if why is None and not within_window and sliding_windows(model.config):
        why = "sliding-window attention (the batched step's kernels attend over every live slot)"
    return why


def _frames_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


_bodies: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, FastBatchBody]]" = weakref.WeakKeyDictionary()


def batch_body(model, mode: str = "compile", within_window: bool = False) -> FastBatchBody | None:
    """The `FastBatchBody` every `BatchGenerator` on ``model`` shares for ``mode`` ("compile" or "fast"), built on
    first use (its compiled graph then serves every later generator: Magpie prompts, answers, held-out
    answers); None for "eager" or a model it does not support (logged: the model's own forward is used).
    ``within_window``: the caller keeps every row within the target's sliding windows (`unsupported_rows`)."""
    if mode not in MODES:
        raise ValueError(f"decoding forward must be one of {MODES}, got {mode!r}")
    if mode == "eager":
        return None
    why = unsupported_rows(model, within_window)
    if why is not None:
        log.warning("the fast batched decode step does not support this model (%s): using its own forward", why)
        return None
    per = _bodies.setdefault(model, {})
    if mode not in per:
        per[mode] = FastBatchBody(model, compile=mode == "compile", core=shared_core(model),
                                  within_window=within_window)
    return per[mode]
