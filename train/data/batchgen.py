"""Continuous-batching generation for self-distillation: many more target tokens per CPU hour.

The reference path (`generate.generate_batch`) hands left-padded batches to
Hugging Face ``generate``: a batch runs until its longest row ends, so rows
that finished early and padding columns keep costing full forwards, and its
growing cache is re-concatenated every step. Here instead:

* one KV cache is allocated once: a row per sequence in flight, each row with
  its own length (`KVCache`), written through the model's public forward
  (4D additive mask, per-row position ids);
* a row whose sequence ends (end-of-turn token or budget) is refilled at
  once from the queue: the batch stays full and no step is spent on a
  finished row. Finished rows are compacted by moving the last row's entries
  into the hole (a copy of one row, not of the batch);
* newly admitted prompts are prefilled together in one forward (right
  padded, causal, so padding never reaches a real position), and only their
  last real positions go through the LM head;
* a decode step's attention reads each row's own entries only (one SDPA call
  per row, `draftsmith.train.data.row_attention`) when rows' lengths differ widely; with similar
  lengths one masked call over the longest live row's span is cheaper (rows of
  similar length travel together when the queue is sorted by prompt length, as
  `generate.regenerate` does).

With ``keep_states`` the engine also keeps every final hidden state it computes (after the final
norm: the prompt's from the prefill, each fed token's from its decode step), so the data stage can
write the training cache without a second pass over the data (`draftsmith.train.data.cache.StreamingCacheWriter`).
As a row ends, the caller names the token sequence it wants states for (the conversation as the
cache will hold it, re-tokenised from text); where that sequence shares a prefix with what the row
computed, the row rewinds to the end of the common prefix and is fed the rest (the chat template's
tail after the end-of-turn token, or a few re-tokenised tokens) in the following steps, its sampled
tokens ignored. A longer difference, or a sequence past the row's capacity, is reported, not fed.

Greedy rows give the tokens the reference path gives (fp32; the products are
the same up to accumulation order, so a flip needs a near-tie, which the tests
and `bench_pipeline` count). Sampling draws each row's tokens from its own
generator seeded by the job, so results do not depend on which rows share a
step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from draftsmith.chat import shared_len
from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.fast_batch import batch_body
from draftsmith.engine.native import ROWS_LINEAR_MAX
from draftsmith.engine.sampling import pick_tokens
from draftsmith.engine.kvcache import KVCache, sliding_windows
from draftsmith.train.data.row_attention import row_attention

ATTENTION_MODES = ("auto", "rows", "masked")


@dataclass
class Job:
    """One prompt to continue: ``key`` identifies it to the caller, ``seed`` seeds its own sampler."""

    key: object
    prompt: list[int]
    max_new_tokens: int
    seed: int = 0


@dataclass
class Captured:
    """What a ``keep_states`` row hands its caller: the states of the wanted sequence, or why there are none.

    ``states``: [len(wanted), hidden] on the CPU in the generator's ``state_dtype``, position t being the
    state after token t; ``reason``: ``"retokenised"`` (the wanted sequence leaves the generated one more
    than ``max_feed`` tokens before its end) or ``"over_capacity"`` (it does not fit the row); ``fed``:
    tokens fed after the row ended; ``rewound``: positions of generated tokens dropped because the wanted
    sequence differs there.
    """

    states: torch.Tensor | None
    reason: str | None = None
    fed: int = 0
    rewound: int = 0


@dataclass
class _Row:
    job: Job
    length: int  # entries in the cache (the prompt plus every generated token but the pending one)
    out: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    feed: deque | None = None  # ended row being fed the rest of its wanted sequence (tokens after the pending one)
    finished: bool = False
    captured: Captured | None = None


class BatchGenerator:
    """Continuous batching over a queue of `Job`s with one pre-allocated `KVCache`.

    Args:
      model: a Hugging Face causal LM (its ``get_decoder()`` body and output embeddings are used).
      eos_ids: tokens that end a sequence (included in the output).
      max_rows: sequences in flight at once (the batch); more rows amortise each weight read
        over more tokens, until attention over the cache dominates.
      capacity: the longest prompt + response a row can hold.
      temperature, top_p: 0 = greedy.
      prefill_tokens: padded prompt tokens per prefill forward (admitted prompts are split to fit).
      keep_states: keep the final hidden states (see the module docstring and `run`'s ``want``).
      state_dtype: the dtype they are kept in (the cache's: rounding from the fp32 forward as the cache pass does).
      max_feed: at most this many tokens are fed to an ended row to complete its wanted sequence.
      admit_rows: while rows are in flight, queued prompts are admitted once this many rows are free (or as
        many as the queue holds): one prefill forward for several rows. Default: max_rows // 12, at least 1
        (Magpie rows end one or two at a time; a prefill of one short prompt cost ~40 ms, half a 96-row step).
      shared_prefix: the token prefix every queued prompt starts with (the chat template's system prompt and
        user header, ~25 tokens for SmolLM2; all of a Magpie prompt but its opener) is computed once and
        its cache entries copied into each admitted row, whose prefill then runs its own tokens only.
      attention: decode-step attention through the model's own forward on CPU, ``"auto"`` (per row when the
        longest live row's span exceeds the rows' mean length by ``row_attention_gap`` slots, see
        `row_attention`), ``"rows"`` or ``"masked"``; elsewhere always one masked call.
      forward: the decode step: ``"compile"`` (`draftsmith.engine.fast_batch`: fused, frozen weights, the native
        ragged attention, compiled once), ``"fast"`` (the same function eager) or ``"eager"`` (the model's own
        forward, with ``attention``, and padded prefills). A model the fast step does not support uses its own
        forward. The fused step prefills too, the admitted prompts as one flat run of tokens.
    """

    def __init__(self, model: torch.nn.Module, eos_ids: Iterable[int], *, max_rows: int = 96, capacity: int = 1024,
                 temperature: float = 0.0, top_p: float = 1.0, prefill_tokens: int = 4096,
                 keep_states: bool = False, state_dtype: torch.dtype = torch.float16, max_feed: int = 32,
                 attention: str = "auto", row_attention_gap: int = 150, shared_prefix: bool = True,
                 forward: str = "eager", admit_rows: int | None = None):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"unknown decode attention {attention!r}; choose one of {ATTENTION_MODES}")
        self.attention, self.row_attention_gap = attention, int(row_attention_gap)
        self.model, self.body, self.head = model, model.get_decoder(), model.get_output_embeddings()
        # rows past a sliding window are refused (`run`), so within it the fused step's kernels are exact
        self.fast = batch_body(model, forward, within_window=True)
        self.forward = forward if self.fast is not None else "eager"
        # Where steps of up to ROWS_LINEAR_MAX rows would compile a graph of their own (`FastBatchBody.graph_rows`)
        # and the batch is wider, those steps (the drain at a run's end) run the same step eagerly: on a 2-core Zen 1
        # EPYC that graph cost a ~60-s compile for steps that are a few percent of a run's time.
        self.eager_rows = eager_rows(self.fast, max_rows)
        self.eos = frozenset(int(e) for e in eos_ids)
        self.max_rows, self.capacity = int(max_rows), int(capacity)
        windows = sliding_windows(model.config)  # within a window, sliding layers attend as full ones do
        self.window = min(windows.values()) if windows else None
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.prefill_tokens = int(prefill_tokens)
        self.admit_rows = max(1, int(admit_rows) if admit_rows is not None else self.max_rows // 12)
        self.shared_prefix = bool(shared_prefix)
        self._prefix: list[int] = []  # the prompts' common prefix, its KV per layer and final states
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._prefix_states: torch.Tensor | None = None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache: KVCache | None = None
        self.keep_states, self.state_dtype, self.max_feed = bool(keep_states), state_dtype, int(max_feed)
        self.states: torch.Tensor | None = None  # [rows, capacity, hidden]: row r's state at each cache slot
        self.stats = {"forwards": 0, "prefill_forwards": 0, "generated_tokens": 0, "prompt_tokens": 0,
                      "row_steps": 0, "compactions": 0, "fed_tokens": 0, "row_attention_steps": 0,
                      "prefix_tokens_reused": 0, "cut_rows": 0}

    def _ensure_cache(self) -> KVCache:
        if self.cache is None:
            # the native kernel and the flat prefill read written slots only: no need to zero the buffers
            zeroed = self.fast is None or not self.fast.native
            self.cache = KVCache(self.model.config, self.capacity, self.dtype, self.device, rows=self.max_rows,
                                 zeroed=zeroed)
            self.kv = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]  # the fused step's view
        if self.keep_states and self.states is None:
            self.states = torch.zeros((self.max_rows, self.capacity, self.model.config.hidden_size),
                                      dtype=self.state_dtype, device=self.device)
        return self.cache

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.head.weight
        if h.device.type == "cpu" and h.shape[0] > 1 and getattr(self.head, "bias", None) is None:
            return (w @ h.T).T  # measured faster than F.linear for tens of rows on this CPU's MKL
        return self.head(h)

    @torch.no_grad()
    def _set_prefix(self, prompts: list[list[int]]) -> None:
        """Compute the cache entries and states of the prompts' longest common prefix (kept while the
        generator lives; a later run whose prompts share less uses the part they share)."""
        if not self.shared_prefix or not prompts:
            return
        common = list(prompts[0])
        for p in prompts[1:]:
            common = common[:shared_len(common, p, len(common))]
            if not common:
                return
        common = common[:min(map(len, prompts)) - 1]  # every row prefills at least its last prompt token
        if len(common) < 2 or common == self._prefix[:len(common)]:
            return
        from transformers import DynamicCache
        pkv = DynamicCache()
        ids = torch.tensor([common], device=self.device)
        h = self.body(input_ids=ids, **cache_arg(self.body, pkv), use_cache=True).last_hidden_state[0]
        self._prefix = common
        self._prefix_kv = [(layer.keys, layer.values) for layer in pkv.layers]
        self._prefix_states = h

    def _offset(self, rows: list[_Row]) -> int:
        """Slots of the shared prefix every row of an admitted group starts with (0: none)."""
        pre = self._prefix
        if not pre:
            return 0
        off = min(len(pre), min(len(r.job.prompt) for r in rows) - 1)
        for r in rows:
            off = shared_len(r.job.prompt, pre, off)
        return off if off >= 2 else 0

    @torch.no_grad()
    def _prefill(self, rows: list[_Row], row0: int) -> list[int]:
        cache = self._ensure_cache()
        off = self._offset(rows)
        if self.fast is not None:
            return self._prefill_flat(rows, row0, off)
        k, width = len(rows), max(len(r.job.prompt) for r in rows) - off
        ids = torch.zeros((k, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r.job.prompt) - off] = torch.tensor(r.job.prompt[off:])
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = torch.cat([torch.ones(width, off, dtype=torch.bool, device=self.device), causal], dim=1)
        mask = torch.zeros((k, 1, width, off + width), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        pos = torch.arange(off, off + width, device=self.device).expand(k, width)
        cache.set_prefill(row0, k, self._prefix_kv, off)
        h = self.body(input_ids=ids.to(self.device), position_ids=pos, attention_mask=mask,
                      **cache_arg(self.body, cache), use_cache=True).last_hidden_state
        if self.states is not None:  # padding positions hold garbage, past every row's length
            if off:
                self.states[row0:row0 + k, :off] = self._prefix_states[:off].to(self.state_dtype)
            self.states[row0:row0 + k, off:off + width] = h.to(self.state_dtype)
        last = torch.tensor([len(r.job.prompt) - 1 - off for r in rows], device=self.device)
        self._count_prefill(rows, off)
        return pick_tokens(self._logits(h[torch.arange(k, device=self.device), last]), rows,
                           self.temperature, self.top_p)

    def _prefill_flat(self, rows: list[_Row], row0: int, off: int) -> list[int]:
        """The fused step's prefill: the group's prompts as one flat run of tokens, no padding."""
        cache = self.cache
        k = len(rows)
        cache.set_prefill(row0, k, self._prefix_kv, off)  # copies the shared prefix into the rows
        h, logits, starts = self.fast.prefill([r.job.prompt for r in rows], list(range(row0, row0 + k)), off, self.kv)
        if self.states is not None:
            for i, r in enumerate(rows):
                if off:
                    self.states[row0 + i, :off] = self._prefix_states[:off].to(self.state_dtype)
                self.states[row0 + i, off:len(r.job.prompt)] = h[starts[i]:starts[i + 1]].to(self.state_dtype)
        self._count_prefill(rows, off)
        return pick_tokens(logits, rows, self.temperature, self.top_p)

    def _count_prefill(self, rows: list[_Row], off: int) -> None:
        self.stats["prefill_forwards"] += 1
        self.stats["prompt_tokens"] += sum(len(r.job.prompt) for r in rows)
        self.stats["prefix_tokens_reused"] += off * len(rows)

    def row_attention(self, lengths: list[int], span: int) -> bool:
        """Attend row by row in this decode step? ``attention="rows"``: always; ``"masked"``: never;
        ``"auto"``: when the padded span exceeds the rows' mean length by ``row_attention_gap`` slots (one
        SDPA call per row costs ~25-50 us of dispatch on this CPU, worth it once the masked call reads ~150
        masked slots per row more than the rows hold; `bench_pipeline --only-data` measures both engines)."""
        if self.attention == "masked" or self.device.type != "cpu":
            return False
        if self.attention == "rows":
            return True
        return span - sum(lengths) / len(lengths) > self.row_attention_gap

    @torch.no_grad()
    def _decode(self, rows: list[_Row], pending: list[int]) -> list[int]:
        cache = self._ensure_cache()
        n = len(rows)
        lengths = [r.length for r in rows]
        lens = torch.tensor(lengths, device=self.device)
        span = max(lengths) + 1
        cache.set_decode(lens, span)
        if self.fast is not None:
            h, logits = self.fast.step(torch.tensor(pending, device=self.device), lens, self.kv, self.eager_rows)
        else:
            allowed = torch.arange(span, device=self.device)[None] <= lens[:, None]
            mask = torch.zeros((n, 1, 1, span), dtype=self.dtype, device=self.device)
            mask.masked_fill_(~allowed[:, None, None], torch.finfo(self.dtype).min)
            ids = torch.tensor(pending, device=self.device)[:, None]
            per_row = self.row_attention(lengths, span)
            with row_attention(self.model, lengths) if per_row else nullcontext():
                h = self.body(input_ids=ids, position_ids=lens[:, None], attention_mask=mask,
                              **cache_arg(self.body, cache), use_cache=True).last_hidden_state[:, 0]
            self.stats["row_attention_steps"] += int(per_row)
            logits = self._logits(h)
        if self.states is not None:
            self.states[torch.arange(n, device=self.device), lens] = h.to(self.state_dtype)
        self.stats["forwards"] += 1
        self.stats["row_steps"] += n
        return pick_tokens(logits, rows, self.temperature, self.top_p)

    def run(self, jobs: Iterable[Job], on_done: Callable[..., Iterable[Job] | None],
            want: Callable[[Job, list[int], bool], list[int] | None] | None = None,
            on_step: Callable[[], None] | None = None,
            admit: Callable[[Job], bool] | None = None,
            cut: Callable[[], bool] | None = None) -> list[Job]:
        """Generate every job; ``on_done(job, tokens, finished)`` is called as each ends and may return
        follow-up jobs (e.g. the next turn of a conversation), which join the queue's front.
        ``on_step()``, if given, is called after every forward (a prefill group or a decode step), with
        ``stats`` up to date: a progress display moves with the tokens while no job has ended yet.

        ``admit(job)``, if given, is asked as a queued job (a follow-up included) would take a free row:
        False drops it unrun (e.g. a time budget that ran out; rows in flight go on to their end). Returns
        the dropped jobs, in queue order. ``cut()``, if given, is asked before each decode step: once it says True,
        every row still generating ends there as unfinished (``on_done(..., finished=False)``, as
        ``max_new_tokens`` ends a row; rows being fed their wanted sequence finish feeding), so a time budget holds
        to a step instead of waiting for the longest row in flight.

        ``tokens`` stop at (and include) the first end-of-sequence token; ``finished`` is False when
        the job's ``max_new_tokens`` cut it.

        With ``keep_states``, ``on_done(job, tokens, finished, captured)`` gets a `Captured` (or None when
        ``want`` asked for nothing): as a row ends, ``want(job, tokens, finished)`` names the token
        sequence whose states the caller wants (None: none). The row computed the states of
        ``prompt + tokens[:-1]``; where the wanted sequence agrees with that up to position L and at most
        ``max_feed`` tokens remain, the row rewinds to L and is fed the remaining tokens one step at a time
        (the causal model makes those states exactly what a forward over the wanted sequence gives).
        """
        queue = deque(jobs)
        for j in queue:
            self._check(j)
        self._set_prefix([j.prompt for j in queue])
        rows: list[_Row] = []
        pending: list[int] = []
        dropped: list[Job] = []
        states = self.keep_states

        def finish(i: int, finished: bool) -> None:
            r = rows[i]
            last = len(rows) - 1
            if i != last:  # keep live rows at [0, n): move the last row into the hole
                self.cache.move_row(last, i, rows[last].length)
                if self.states is not None:
                    self.states[i, :rows[last].length] = self.states[last, :rows[last].length]
                rows[i], pending[i] = rows[last], pending[last]
                self.stats["compactions"] += 1
            rows.pop()
            pending.pop()
            follow = on_done(r.job, r.out, finished, r.captured) if states else on_done(r.job, r.out, finished)
            for j in reversed(list(follow or [])):
                self._check(j)
                queue.appendleft(j)

        def end(i: int, finished: bool) -> bool:
            """Row i generated its last token: feed it the rest of its wanted sequence, or finish it."""
            r = rows[i]
            wanted = want(r.job, r.out, finished) if states and want is not None else None
            if wanted is not None:
                have = r.job.prompt + r.out[:-1]  # the tokens whose states the row holds (r.length of them)
                common = shared_len(have, wanted)
                rest = len(wanted) - common
                if len(wanted) > self.capacity:
                    r.captured = Captured(None, "over_capacity")
                elif rest > self.max_feed:
                    r.captured = Captured(None, "retokenised")
                elif rest == 0:
                    r.captured = Captured(self.states[i, :len(wanted)].cpu().clone(), rewound=r.length - common)
                else:
                    r.captured = Captured(None, fed=rest, rewound=r.length - common)
                    r.length, r.finished = common, finished
                    r.feed = deque(wanted[common + 1:])
                    pending[i] = wanted[common]
                    self.stats["fed_tokens"] += rest
                    return False
            finish(i, finished)
            return True

        def advance(i: int, tok: int) -> bool:
            """Record a generated token for row i; True if the row ended (and was removed)."""
            r = rows[i]
            if r.feed is not None:  # an ended row being fed: its sampled token is not used
                if r.feed:
                    pending[i] = r.feed.popleft()
                    return False
                r.captured.states = self.states[i, :r.length].cpu().clone()
                finish(i, r.finished)
                return True
            r.out.append(tok)
            self.stats["generated_tokens"] += 1
            if tok in self.eos:
                return end(i, True)
            if len(r.out) >= r.job.max_new_tokens:
                return end(i, False)
            pending[i] = tok
            return False

        was_cut = False
        while queue or rows:
            if cut is not None and not was_cut and rows and cut():
                was_cut = True
                self.stats["cut_rows"] += sum(r.feed is None for r in rows)
                for i in range(len(rows) - 1, -1, -1):  # backwards: `finish` moves the last row into the hole
                    if rows[i].feed is None:
                        end(i, False)
                continue
            # admit new prompts into free rows, prefilled together in budget-sized groups, once enough rows are free
            # (a prefill forward costs about a decode step whatever its size): `admit_rows`, or what the queue holds
            wait = bool(rows) and self.max_rows - len(rows) < min(self.admit_rows, len(queue))
            while queue and len(rows) < self.max_rows and not wait:
                group: list[_Row] = []
                width = 0
                while queue and len(rows) + len(group) < self.max_rows:
                    j = queue[0]
                    if admit is not None and not admit(j):
                        dropped.append(queue.popleft())
                        continue
                    w = max(width, len(j.prompt))
                    if group and w * (len(group) + 1) > self.prefill_tokens:
                        break
                    queue.popleft()
                    width = w
                    if j.max_new_tokens <= 0:
                        follow = on_done(j, [], False, None) if states else on_done(j, [], False)
                        for f in reversed(list(follow or [])):
                            self._check(f)
                            queue.appendleft(f)
                        continue
                    gen = None
                    if self.temperature > 0:
                        gen = torch.Generator(device="cpu").manual_seed(int(j.seed) % (2 ** 63))
                    group.append(_Row(j, len(j.prompt), gen=gen))
                if not group:
                    continue
                row0 = len(rows)
                first = self._prefill(group, row0)
                rows.extend(group)
                pending.extend([0] * len(group))
                # walk backwards so compaction (which moves the last row) never skips a row
                for i in range(len(rows) - 1, row0 - 1, -1):
                    advance(i, first[i - row0])
                if on_step is not None:
                    on_step()
            if not rows:
                continue
            nxt = self._decode(rows, list(pending))
            for r in rows:
                r.length += 1
            for i in range(len(rows) - 1, -1, -1):
                advance(i, nxt[i])
            if on_step is not None:
                on_step()
        return dropped

    def _check(self, job: Job) -> None:
        if not job.prompt:
            raise ValueError(f"job {job.key!r}: empty prompt")
        need = len(job.prompt) + job.max_new_tokens
        if need > self.capacity:
            raise ValueError(f"job {job.key!r}: {len(job.prompt)} prompt tokens + {job.max_new_tokens} new tokens "
                             f"exceed the generator's row capacity {self.capacity}")
        if self.window is not None and need > self.window:
            raise ValueError(f"job {job.key!r}: {len(job.prompt)} prompt tokens + {job.max_new_tokens} new tokens "
                             f"exceed the target's sliding attention window of {self.window} tokens, which the data "
                             "engine's masks do not apply; shorten the prompt or max_new_tokens")


def eager_rows(fast, max_rows: int) -> int:
    """Steps of at most this many rows run the fused step eagerly (`BatchGenerator.eager_rows`): where they would
    compile a graph of their own beside a wider batch's (``fast``: the `FastBatchBody`, or None), ROWS_LINEAR_MAX."""
    graphs = fast.graph_rows(int(max_rows)) if fast is not None else []
    return ROWS_LINEAR_MAX if len(graphs) > 1 else 0


def warm_up(model, forward: str, max_rows: int) -> dict:
    """Compile the fused step's graphs that generation with up to ``max_rows`` rows will run
    (`FastBatchBody.graph_rows`, less the small steps `BatchGenerator.eager_rows` runs eagerly), by generating two
    tokens for that many copies of a 4-token prompt, so that a time budget started afterwards buys generation and
    not compiling. Measured on a 2-core AVX2 EPYC (Zen 1): the data engine's two graphs compiled in about 110 and
    60 s, inside a 330-s data budget. Returns ``{"seconds", "graphs"}`` (0 and [] when nothing compiles: an eager
    or ``fast`` step, or a model the fused step does not support)."""
    fast = batch_body(model, forward, within_window=True)
    if fast is None or fast.compiled is None:
        return {"seconds": 0.0, "graphs": []}
    t0 = time.perf_counter()
    sizes = [n for n in fast.graph_rows(max_rows) if n > eager_rows(fast, max_rows)]
    for n in sizes:
        gen = BatchGenerator(model, (), max_rows=n, capacity=8, forward=forward, shared_prefix=False,
                             admit_rows=n)
        gen.run([Job(i, [1 + i % 5, 2, 3, 4], 2) for i in range(n)], lambda *a: None)
    return {"seconds": round(time.perf_counter() - t0, 1), "graphs": sizes}


def suggested_rows(config, capacity: int, dtype: torch.dtype, budget_bytes: int, max_rows: int) -> int:
    """The most rows (<= max_rows) whose KV cache fits ``budget_bytes``."""
    per_row = KVCache.bytes_needed(config, 1, capacity, dtype)
    return max(1, min(max_rows, math.floor(budget_bytes / per_row)))
