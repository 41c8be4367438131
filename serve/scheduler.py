"""The server's batching thread: a bounded queue of requests and continuous batching on the batched decoder.

One background thread is the only one that touches the model (``max_batch > 1``). It takes the oldest waiting
request and the waiting ones that can share a call with it (the same sampling settings), up to ``max_batch``,
and decodes them with `draftsmith.engine.batched.BatchedSpeculativeDecoder`. While that call runs, requests that
arrive join it between steps as rows free up (continuous batching: ``generate(admit=...)``), as long as they
fit its cache and share its sampling settings, and the oldest waiting request is one of them (first come, first
served: a request with other settings stops admission and heads the next call). Each row streams and logs as it
commits and leaves. A newly published drafter stops admission; the call drains and the next one uses it.

Admissions can be grouped, as the data engine groups them: the rows admitted before a step are prefilled together
in one forward, so closed-loop clients that come back one at a time each cost the batch a forward of their own.
With ``admit_group`` above 1, waiting requests are held while rows are decoding until that many can join at once
(and as many rows are free), for at most ``admit_hold_steps`` steps; a call with no live rows never holds. The
default is 1 (no holding): with MT-Bench prompts at 32 closed-loop clients on a 2-core CPU, groups of 4 cut the
admissions from 163 to 38 and left the throughput where it was (185.95 against 187.59 tok/s). Long prompts,
whose prefills are dear, are where it may pay.

A drafter the batched decoder refuses (self-drafters such as Kangaroo, dynamic trees, drafters with their own
tokenizer, non-fixed draft lengths) is served one request at a time by the same thread with the single-sequence
decoder. The hybrid (a drafter beside SuffixDecoding) decodes a request that finds no other waiting with the
single-sequence decoder, and requests that come together in a batched call with SuffixDecoding alone.

The queue is bounded (``max_queue`` waiting requests, plus as many as the running loop has rows free: they join
before its next step): past it, `submit` raises `QueueFull` with a Retry-After estimate, which the routes answer
with 429. So a burst that reaches an idle server with ``max_batch`` rows is answered up to ``max_batch +
max_queue`` requests, not cut at ``max_queue`` because it arrived before the loop took the first ones in. A
request whose client went away (its ``cancel`` event set) is dropped from the queue, or ends its row at the next
step; it is not logged, and counted in ``aborted``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftsmith.engine.batched import BatchedSpeculativeDecoder, NewRow
from draftsmith.engine.processors import RequestProcessing
from draftsmith.engine.sampling import TorchRandom

from draftsmith.serve.request import BadRequest, Spec, TextStream

if TYPE_CHECKING:  # the service creates the scheduler; typing only
    from draftsmith.serve.service import DecodingService

log = logging.getLogger("draftsmith.serve")

#: how often (seconds) a running batch looks for a newly published drafter before admitting rows
SWAP_CHECK_S = 1.0
#: steps a waiting request may be held for its admission group (see the module docstring)
ADMIT_HOLD_STEPS = 8


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: answer 429 with ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting (the queue's bound); retry in "
                         f"{retry_after} s")
        self.waiting, self.retry_after = waiting, retry_after


class Cancelled(Exception):
    """The request's client went away; it was stopped and not logged."""


@dataclass(eq=False)
class Job:
    """A queued request: what to decode, its cancel event, and the events its caller reads."""

    spec: Spec
    request_id: str | None
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: TextStream | None = None
    proc: RequestProcessing | None = None
    events: "queue.SimpleQueue[dict]" = field(default_factory=queue.SimpleQueue)
    ids: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    sent_logprobs: int = 0
    started: float = 0.0
    finished: bool = False
    deltas: bool = True  # False: the caller reads the record only (a request that does not stream)

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def abandon(self) -> None:
        """End the job for a client that left: its caller (if still reading) gets `Cancelled`."""
        self.finished = True
        self.events.put({"error": Cancelled("the client went away")})


class Scheduler:
    """The bounded queue and the batching thread of a `DecodingService` (see the module docstring)."""

    def __init__(self, service: "DecodingService", max_batch: int, max_queue: int, admit_group: int = 1,
                 admit_hold_steps: int = ADMIT_HOLD_STEPS):
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {max_queue!r}")
        if not isinstance(admit_group, int) or not 1 <= admit_group <= max_batch:
            raise ValueError(f"admit_group must be an integer from 1 to max_batch ({max_batch}), got {admit_group!r}")
        if not isinstance(admit_hold_steps, int) or admit_hold_steps < 0:
            raise ValueError(f"admit_hold_steps must be a non-negative integer, got {admit_hold_steps!r}")
        self.service, self.max_batch, self.max_queue = service, max_batch, max_queue
        self.admit_group, self.admit_hold_steps = admit_group, admit_hold_steps
        self.admit_groups: list[int] = []  # rows each admission into a running call brought, in order
        self.held_steps = 0  # steps at which ready requests were held for their group
        self.batch_sizes: list[int] = []  # rows every batched call started with, in order
        self.admitted = 0  # rows that joined a running call
        self.unbatched = 0  # requests decoded one at a time (unbatchable drafter)
        self.refused = 0  # requests refused with QueueFull
        self._cv = threading.Condition()
        self._waiting: list[Job] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._swap_checked = 0.0
        self._current: list[Job | None] = []  # the running call's rows (None once finished)
        self._looping = False  # the batching loop runs (its thread, or `run_here`)

    # ------------------------------------------------------------------ the callers' side
    def submit(self, job: Job) -> None:
        """Queue a job; `QueueFull` past the bound, RuntimeError once closed."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the decoding service is closed")
            if len(self._waiting) >= self._bound():
                self.refused += 1
                raise QueueFull(len(self._waiting), self.service.retry_after(len(self._waiting), self.max_batch))
            self._waiting.append(job)
            self._cv.notify_all()

    def _bound(self) -> int:
        """Requests that may wait: ``max_queue``, plus the rows the running loop has free (none while no loop runs:
        nothing would take them)."""
        if not self._looping or self.service.batched is None:  # an unbatchable drafter: one row at a time
            return self.max_queue
        live = sum(j is not None for j in self._current)
        return self.max_queue + max(0, self.max_batch - live)

    def queued(self) -> int:
        with self._cv:
            return len(self._waiting)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="draftsmith-batcher", daemon=True)
            self._thread.start()

    def run_here(self) -> None:
        """Run the batching loop in the calling thread until `stop` or `close` (``draftsmith serve`` runs it in
        the process's main thread: see `draftsmith.serve.service.DecodingService.run_forever`)."""
        self._loop()

    def stop(self) -> None:
        """Ask the loop to end after the current call, without waiting (safe in a signal handler)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def close(self, timeout: float | None = 30) -> None:
        """Stop after the current call (its rows finish; requests still queued get an error)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the batching thread
    def _drop_cancelled(self) -> None:
        """Jobs whose client left while queued: out of the queue, counted (call with ``_cv`` held)."""
        gone = [j for j in self._waiting if j.cancelled]
        if gone:
            self.service.aborted += len(gone)
            self._waiting = [j for j in self._waiting if not j.cancelled]
            for j in gone:
                j.abandon()

    def _take(self) -> list[Job]:
        """The next call's rows: the oldest waiting request and the next waiting ones with the same sampling
        settings (greedy requests always share a call; seeds and penalties never split one); one request when
        the current drafter cannot be batched."""
        with self._cv:
            self._drop_cancelled()
            if not self._waiting:
                return []
            first = self._waiting[0]
            n = self.max_batch if self.service.batched is not None else 1
            jobs = [j for j in self._waiting if j.spec.sampling == first.spec.sampling][:n]
            self._waiting = [j for j in self._waiting if all(j is not b for b in jobs)]
            self._current = list(jobs)  # they hold rows from now on (`_bound`), not from when the call starts
            return jobs

    def _loop(self) -> None:
        self._looping = True
        try:
            self._serve()
        finally:
            self._looping = False

    def _serve(self) -> None:
        svc = self.service
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    pending, self._waiting = self._waiting, []
                    break
            svc.refresh()  # only here, between calls: a swap never lands inside one
            jobs = self._take()
            if not jobs:
                continue
            try:
                if svc.batched is None or (svc.lone_single and len(jobs) == 1 and not self.queued()):
                    self._run_single(jobs[0])
                else:
                    self._run_batch(svc.batched, jobs)
            except Exception as e:  # noqa: BLE001 (the thread must survive; the callers get the error)
                log.exception("decoding a batch of %d requests failed", len(jobs))
                for j in [*jobs, *(x for x in self._current if x is not None)]:  # rows that joined it too
                    if not j.finished:
                        j.finished = True
                        j.events.put({"error": e})
        for j in pending:
            j.events.put({"error": RuntimeError("the decoding service was closed")})

    def _run_single(self, job: Job) -> None:
        self.unbatched += 1
        gen = self.service._decode_one(self.service.decoder, job.spec, job.request_id, job.cancel)
        try:
            while True:
                job.events.put(next(gen))
        except StopIteration as stop:
            job.finished = True
            job.events.put({"done": stop.value})
        except Cancelled:
            job.abandon()
        except Exception as e:  # noqa: BLE001 (BadRequest and the rest: the caller gets it)
            job.finished = True
            job.events.put({"error": e})

    def _swap_due(self) -> bool:
        """A newly published drafter is waiting (checked at most every `SWAP_CHECK_S`)."""
        store = self.service.store
        now = time.monotonic()
        if store is None or now - self._swap_checked < SWAP_CHECK_S:
            return False
        self._swap_checked = now
        return store.current() not in (self.service.version, self.service.failed)

    def _ready(self, dec: BatchedSpeculativeDecoder, job: Job) -> bool:
        """Check a row as the decoder will (a bad request fails alone) and set up its text stream; False
        (the caller told) for a refused row."""
        try:
            dec._rows([job.spec.prompt], [job.spec.max_tokens])
        except ValueError as e:  # prompt too long for the context with this drafter's block
            job.finished = True
            job.events.put({"error": BadRequest(str(e).removeprefix("row 0: "), "max_tokens")})
            return False
        job.stream = TextStream(self.service.target.tokenizer, job.spec.stops)
        job.proc = job.spec.processing(self.service.target.vocab_size)
        job.started = time.time()
        return True

    def _run_batch(self, dec: BatchedSpeculativeDecoder, jobs: list[Job]) -> None:
        svc = self.service
        rows: list[Job | None] = [j for j in jobs if self._ready(dec, j)]
        self._current = rows
        if not rows:
            return
        sampling = dec.sampling = rows[0].spec.sampling
        dec.set_prefix(svc.prompt_prefix)  # a decoder swapped in since the last call gets it too
        version, kind = svc.version, svc.batched_kind
        self.batch_sizes.append(len(rows))
        # the cache is sized once per call, for the longest row the limits allow (rows that need more wait)
        # (on a target with sliding windows: the window while the rows fit in it, where the fused step runs)
        capacity = dec.call_capacity(max(dec.positions(len(j.spec.prompt), j.spec.max_tokens) for j in rows),
                                     svc.batch_positions)
        held = [0]  # steps the head of the queue has been held for its admission group

        def admit(free: int) -> list[NewRow]:
            if self._closed or self._swap_due():
                return []
            take = []
            with self._cv:
                self._drop_cancelled()
                ready = 0  # waiting requests, from the oldest, that may join this call
                for j in self._waiting[:free]:
                    if j.spec.sampling != sampling or not dec.fits(len(j.spec.prompt), j.spec.max_tokens):
                        break  # it heads the next call
                    ready += 1
                live = self.max_batch - free
                if ready and live and min(ready, free) < self.admit_group and held[0] < self.admit_hold_steps:
                    held[0] += 1  # wait for the group: one prefill forward for all of it
                    self.held_steps += 1
                    return []
                held[0] = 0
                take, self._waiting = self._waiting[:ready], self._waiting[ready:]
            new = []
            for j in take:
                if self._ready(dec, j):
                    rows.append(j)
                    self.admitted += 1
                    new.append(NewRow(j.spec.prompt, j.spec.max_tokens, TorchRandom(j.spec.seed), j.proc))
            if new:
                self.admit_groups.append(len(new))
            return new

        def on_step(row: int, new_ids: list[int], st, stop: str | None) -> bool:
            j = rows[row]
            if j.cancelled:  # the client left: end the row now, nothing logged
                svc.aborted += 1
                j.abandon()
                rows[row] = None  # a call may run for hours: finished jobs are let go
                return True
            j.ids.extend(new_ids)
            j.steps.append([st.accepted, st.attempted, st.drafted, st.emitted])
            if not j.deltas and not j.spec.stops and stop is None:
                return False  # nothing to send and no stop sequence to look for: the text is made once, at the end
            delta = j.stream.push(j.ids, stop is not None)
            lps = []
            if j.proc is not None and j.proc.recording:
                lps = j.proc.logprobs[j.sent_logprobs:len(j.ids)]
            if delta or j.stream.stopped:
                j.sent_logprobs += len(lps)
                j.events.put({"delta": delta, "logprobs": lps})
            if stop is not None or j.stream.stopped:  # the row leaves the batch: its response is complete
                finish = "stop" if j.stream.stopped or stop == "eos" else "length"
                rec = svc._finish(j.spec, list(j.ids), j.stream.text, finish, j.steps, j.request_id, j.started,
                                  version, kind)
                rec["_logprobs"] = j.proc.logprobs[:len(j.ids)] if j.proc is not None and j.proc.recording else None
                j.finished = True
                j.events.put({"done": rec})
                rows[row] = None
                return j.stream.stopped
            return False

        dec.generate([j.spec.prompt for j in rows], [j.spec.max_tokens for j in rows],
                     rngs=[TorchRandom(j.spec.seed) for j in rows], on_step=on_step,
                     processing=[j.proc for j in rows], admit=admit, max_rows=self.max_batch, capacity=capacity,
                     release=True)


def retry_after_s(waiting: int, max_batch: int, latency_s: float) -> int:
    """Seconds a refused client should wait: the queue ahead of it drained ``max_batch`` at a time, each round
    the recent mean latency; at least 1, at most 120."""
    return int(min(120, max(1, math.ceil(latency_s * max(1.0, waiting / max(1, max_batch))))))
