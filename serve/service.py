"""The decoding service behind the server: one target, the current published drafter, its decoders, the request
log, and either a lock (one request at a time) or the batching scheduler (`draftsmith.serve.scheduler`).

Every request is decoded losslessly with the drafter that is current in the publish directory (plain decoding
when none is); a version that fails to load leaves the previous one serving (logged). Every answered request is
written as one JSON line (`draftsmith.traffic`, schema in docs/online.md); with ``log_bodies=False`` the line
keeps the request's settings and the token ids (what the online job trains on) but not its messages, prompt or
response text. A request whose client went away (its cancel event set, or its event stream closed) is stopped at
the next step and not logged (counted in ``aborted``).

Two modes (``max_batch``):
  * ``max_batch == 1``: `draftsmith.engine.decoder.SpeculativeDecoder` runs one generation at a time in the
    request's own thread, under a lock; a newly published drafter is picked up when the lock is taken for the
    next request, never during one. At most ``max_queue`` requests wait for the lock; past that, `QueueFull`.
  * ``max_batch > 1``: requests are queued for the scheduler's thread, the only one that touches the model
    (continuous batching with `draftsmith.engine.batched.BatchedSpeculativeDecoder`; see
    `draftsmith.serve.scheduler`).

SuffixDecoding (``suffix=SuffixConfig(...)``): one global index per service (`draftsmith.serve.suffix_state`),
shared by every request and kept across drafter swaps, drafts alone while nothing is published and beside the
published drafter (`HybridDrafter`) otherwise. Every logged response is added to it as it finishes, so the
index is always the suffix index of the log. The hybrid runs in the single-sequence decoder only: with
``max_batch > 1`` a request that finds no other waiting decodes with it alone, and requests that come together
are batched with SuffixDecoding alone (logged with kind ``suffix``), so a burst is batched rather than queued.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Generator, Iterator

import torch

from draftsmith.chat import shared_prompt_prefix
from draftsmith.checkpoint import drafter_from_checkpoint, read_manifest
from draftsmith.drafters.suffix import HybridDrafter, SuffixConfig
from draftsmith.engine.batched import BatchedSpeculativeDecoder, plain_batched_decoder
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.processors import Penalties, TokenLogprob
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.tree_build import parse_tree
from draftsmith.publish import PublishStore, load_current
from draftsmith.serve.request import BadRequest, Spec, TextStream
from draftsmith.serve.scheduler import ADMIT_HOLD_STEPS, Cancelled, Job, QueueFull, Scheduler, retry_after_s
from draftsmith.serve.schema import ChatRequest, CompletionRequest
from draftsmith.serve.suffix_state import SuffixState
from draftsmith.target import Target
from draftsmith.traffic import TrafficLog, chat_prompt_ids, make_record

log = logging.getLogger("draftsmith.serve")

#: the request fields a log without bodies leaves out (the conversation and the text; settings stay)
BODY_FIELDS = ("messages", "prompt", "suffix", "user")


class DecodingService:
    """One target, the current published drafter, its decoders, a request lock or a batching scheduler, the log.

    ``max_batch``: 1 decodes one request at a time under a lock in the caller's thread; more queues requests
    for one batching thread (`draftsmith.serve.scheduler`), started at once unless ``start=False`` (then call
    `start`; tests queue requests first to see them batched). ``max_queue``: requests that may wait; past it
    `QueueFull` (429). ``max_prompt_tokens`` / ``max_tokens_limit``: a request over either is a `BadRequest`
    naming it (None: the target's context length bounds them). ``batch_positions``: cache positions per row a
    batched call allocates at least (rows that need more wait for a call of their own; on a target with sliding windows
    at most the window while the call's rows fit in it, where the fused step runs). ``log_bodies``: False
    leaves messages, prompts and texts out of the request log.

    ``suffix``: SuffixDecoding's settings (None: off). ``suffix_state``: where its global index is saved and
    loaded (default ``log_dir/suffix-index`` when there is a log, else nowhere); ``suffix_save_every``: save
    after this many indexed responses (0: at `close` only)."""

    def __init__(self, target: Target, *, publish_dir: str | Path | None = None, log_dir: str | Path | None = None,
                 tree: str = "chain", model_name: str | None = None, max_log_bytes: int = 64 << 20,
                 default_max_tokens: int = 256, max_batch: int = 1, start: bool = True,
                 suffix: SuffixConfig | None = None, suffix_state: str | Path | None = None,
                 suffix_save_every: int = 100, max_queue: int = 256, max_prompt_tokens: int | None = None,
                 max_tokens_limit: int | None = None, log_bodies: bool = True, batch_positions: int = 2048,
                 admit_group: int = 1, admit_hold_steps: int = ADMIT_HOLD_STEPS, draft_max_rows: int | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        for name, v in (("max_prompt_tokens", max_prompt_tokens), ("max_tokens_limit", max_tokens_limit)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        self.target = target
        self.draft_max_rows = draft_max_rows  # batched calls draft only while at most this many rows are live
        self.max_batch = max_batch
        self.store = PublishStore(publish_dir) if publish_dir else None
        self.log = TrafficLog(log_dir, max_log_bytes) if log_dir else None
        self.log_bodies = log_bodies
        self.tree_spec = tree
        self.model_name = model_name or target.name
        self.default_max_tokens = default_max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.max_tokens_limit = max_tokens_limit
        self.batch_positions = batch_positions
        self.max_queue = max_queue
        self.lock = threading.Lock()
        self._lock_waiting = 0  # requests waiting for the lock (max_batch == 1)
        self._count_lock = threading.Lock()
        self.latency_s = 5.0  # running mean of finished requests' latency (Retry-After estimates)
        self.version: str | None = None
        self.failed: str | None = None
        self.kind: str | None = None
        self.decoder = SpeculativeDecoder(target, None)
        # what every chat prompt starts with (the template's system prompt and user header): the batched decoder
        # prefills it once and copies its entries into each row
        self.prompt_prefix = shared_prompt_prefix(target.tokenizer)
        # the batched decoder of the current drafter; None while it cannot be batched (one at a time)
        self.batched: BatchedSpeculativeDecoder | None = plain_batched_decoder(target) if max_batch > 1 else None
        self.swaps = 0
        self.served = 0
        self.aborted = 0  # requests stopped because their client went away (not logged)
        self.refused_lock = 0  # requests refused with QueueFull while waiting for the lock (max_batch == 1)
        self.scheduler = (Scheduler(self, max_batch, max_queue, admit_group, admit_hold_steps) if max_batch > 1
                          else None)
        self.suffix_state_: SuffixState | None = None
        if suffix is not None:
            state = Path(suffix_state) if suffix_state else Path(log_dir) / "suffix-index" if log_dir else None
            self.suffix_state_ = SuffixState(target, suffix, state, suffix_save_every, log_dir)
            self.decoder = SpeculativeDecoder(target, self.suffix)
            self.batched = self._suffix_batched() if max_batch > 1 else None
            self.kind = "suffix"
        elif suffix_save_every < 0:
            raise ValueError(f"suffix_save_every must be >= 0, got {suffix_save_every}")
        self.refresh()
        if max_batch > 1 and start:
            self.start()

    # ------------------------------------------------------------------ SuffixDecoding's global index
    @property
    def suffix(self):
        """The global `SuffixDrafter` (None: SuffixDecoding is off)."""
        return None if self.suffix_state_ is None else self.suffix_state_.drafter

    @property
    def suffix_state(self) -> Path | None:
        return None if self.suffix_state_ is None else self.suffix_state_.state_dir

    @property
    def suffix_start(self) -> dict | None:
        return None if self.suffix_state_ is None else self.suffix_state_.start

    @property
    def suffix_saves(self) -> int:
        return 0 if self.suffix_state_ is None else self.suffix_state_.saves

    def save_suffix(self) -> bool:
        """Save the global index (False: off, nowhere to save, or saving failed: logged)."""
        return self.suffix_state_ is not None and self.suffix_state_.save()

    def suffix_report(self) -> dict | None:
        """The global index's memory report, where it is saved and how it was made at start (None: off)."""
        return None if self.suffix_state_ is None else self.suffix_state_.report()

    # ------------------------------------------------------------------ drafters
    def _load(self, path: Path):
        drafter = drafter_from_checkpoint(path, self.target)
        tree = parse_tree(self.tree_spec, path) if capabilities(drafter).supports_trees else None
        kind = read_manifest(path).get("kind")
        hybrid = False
        if self.suffix is not None:
            try:
                drafter, kind, hybrid = HybridDrafter(drafter, self.suffix), f"{kind}+suffix", True
            except ValueError as e:  # a self-drafter or a drafter building its own trees
                log.warning("drafter %s cannot draft beside SuffixDecoding (%s): serving it alone (the suffix "
                            "index still learns from every response)", path.name, e)
        dec = SpeculativeDecoder(self.target, drafter, tree=tree)
        if self.max_batch == 1:
            return dec, None, kind
        if hybrid:
            log.warning("drafter %s beside SuffixDecoding (the hybrid) runs in the single-sequence decoder only: a "
                        "request alone decodes with it, concurrent ones are batched with SuffixDecoding alone",
                        path.name)
            return dec, self._suffix_batched(), kind
        return dec, self._batched_for(dec, path.name), kind

    def _suffix_batched(self) -> BatchedSpeculativeDecoder:
        """The batched decoder drafting with SuffixDecoding alone (nothing published, or beside the hybrid)."""
        return BatchedSpeculativeDecoder(self.target, self.suffix, draft_max_rows=self.draft_max_rows)

    @property
    def lone_single(self) -> bool:
        """A request alone decodes with the single-sequence decoder, whose drafter the batched one lacks (the
        hybrid; the batched decoder drafts with SuffixDecoding alone)."""
        return self.batched is not None and self.batched.drafter is not self.decoder.drafter

    @property
    def batched_kind(self) -> str | None:
        """The drafter kind batched calls decode with (logged with their responses)."""
        return "suffix" if self.lone_single else self.kind

    def _batched_for(self, dec: SpeculativeDecoder, version: str) -> BatchedSpeculativeDecoder | None:
        """The batched decoder drafting exactly as ``dec`` does (same drafter, tree, fixed K), or None."""
        try:
            if dec.tree is None and not isinstance(dec.policy, FixedLength):
                raise ValueError(f"its draft length policy ({type(dec.policy).__name__}) is per sequence")
            return BatchedSpeculativeDecoder(self.target, dec.drafter, tree=dec.tree, k=dec.policy.max_len,
                                             draft_max_rows=self.draft_max_rows)
        except Exception as e:  # noqa: BLE001 (any refusal: serve it one request at a time rather than fail)
            log.warning("drafter %s cannot be batched (%s): serving it one request at a time", version, e)
            return None

    def refresh(self) -> None:
        """Switch to the published current drafter if it changed (call with the lock held, from the batching
        thread between calls, or before serving)."""
        if self.store is None or self.store.current() in (self.version, self.failed):
            return
        try:
            version, loaded = load_current(self.store, self._load)
        except Exception as e:  # a broken version must not take the server down: keep serving the previous one
            self.failed = self.store.current()  # not retried until current moves again
            log.error("could not load published drafter %s: %s; still serving %s", self.failed, e, self.version)
            return
        if version is None:
            return
        self.decoder, self.batched, self.kind = loaded
        self.version = version
        self.swaps += 1
        log.info("serving drafter %s (%s)", version, self.kind)

    # ------------------------------------------------------------------ requests
    def spec(self, req: ChatRequest | CompletionRequest, body: dict) -> Spec:
        """The decoding spec of a validated request; `BadRequest` for what only the target can check."""
        tok, V = self.target.tokenizer, self.target.vocab_size
        if isinstance(req, ChatRequest):
            kind = "chat"
            prompt = chat_prompt_ids(tok, [m.template_dict() for m in req.messages])
        else:
            kind = "completion"
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], str):
                p = p[0]
            if isinstance(p, list) and p and isinstance(p[0], list):
                p = p[0]
            if isinstance(p, str):
                prompt = [int(x) for x in tok(p)["input_ids"]]
            else:
                bad = [x for x in p if x >= V]
                if bad:
                    raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{V - 1})", "prompt")
                prompt = list(p)
            if not prompt:
                raise BadRequest("the prompt is empty after tokenisation", "prompt")
        field_ = "messages" if kind == "chat" else "prompt"
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            raise BadRequest(f"prompt too long: {len(prompt)} tokens; this server takes at most "
                             f"{self.max_prompt_tokens} (--max-prompt-tokens)", field_)
        max_tokens = req.max_new(self.default_max_tokens)
        if self.max_tokens_limit is not None and max_tokens > self.max_tokens_limit:
            raise BadRequest(f"max_tokens {max_tokens} is over this server's limit of {self.max_tokens_limit} "
                             f"(--max-tokens-limit)", "max_tokens")
        need = len(prompt) + max_tokens + 1
        if need > self.target.context_length:
            raise BadRequest(f"prompt too long: {len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the "
                             f"target's context length {self.target.context_length}", "max_tokens")
        temp = 1.0 if req.temperature is None else req.temperature
        if temp == 0.0:
            sp = SamplingParams(0.0)
        else:
            top_p = 1.0 if req.top_p is None else max(req.top_p, 1e-12)  # 0: only the most probable token
            sp = SamplingParams(temp, max(req.top_k or 0, 0), top_p, req.min_p or 0.0)
        bias = req.bias()
        out_of_vocab = [t for t, _ in bias if t >= V]
        if out_of_vocab:
            raise BadRequest(f"logit_bias token ids {out_of_vocab[:5]} are outside the vocabulary (0..{V - 1})",
                             "logit_bias")
        pen = Penalties(req.frequency_penalty, req.presence_penalty, req.repetition_penalty, bias)
        return Spec(body, kind, prompt, sp, max_tokens, req.seed, pen, req.want_logprobs(), req.stops())

    def prompt_logprobs(self, spec: Spec) -> list[TokenLogprob]:
        """For ``echo`` with ``logprobs``: each prompt token's log-probability under the target (raw logits, one
        cache-free forward; the first token has none) and its ``top_logprobs`` alternatives."""
        ids = spec.prompt
        dev = next(self.target.model.parameters()).device
        with torch.no_grad():
            lp = torch.log_softmax(self.target.model(torch.tensor([ids], device=dev)).logits[0].double(), -1)
        k = spec.top_logprobs or 0
        out = [TokenLogprob(ids[0], None, [])]
        for i in range(1, len(ids)):
            top = torch.topk(lp[i - 1], k) if k else None
            out.append(TokenLogprob(ids[i], float(lp[i - 1, ids[i]]),
                                    list(zip(top.indices.tolist(), top.values.tolist())) if k else []))
        return out

    def retry_after(self, waiting: int, max_batch: int) -> int:
        """Seconds a client refused for a full queue should wait (`draftsmith.serve.scheduler.retry_after_s`)."""
        return retry_after_s(waiting, max_batch, self.latency_s)

    def run(self, spec: Spec, request_id: str | None = None,
            cancel: threading.Event | None = None, deltas: bool = True) -> Iterator[dict]:
        """Admit one request and return its events: a generator that yields ``{"delta": text, "logprobs": [...]}``
        as the response grows and returns the record. Admission is checked here, before any event: `QueueFull`
        when ``max_queue`` requests already wait. The generator raises `Cancelled` once ``cancel`` is set (the
        request stopped at the next step, not logged); a consumer that closes it early cancels it too.
        ``deltas=False`` (a request that does not stream): with ``max_batch > 1`` the batch's steps make no text
        and send no event until the record, unless a stop sequence has to be looked for (one detokenisation and
        one thread wake-up a row a step fewer)."""
        cancel = cancel or threading.Event()
        if self.scheduler is None:
            waiting = self._lock_waiting  # read without the lock: concurrent arrivals may pass it by a few
            if waiting >= self.max_queue:
                self.refused_lock += 1
                raise QueueFull(waiting, self.retry_after(waiting, 1))
            return self._run_locked(spec, request_id, cancel)
        job = Job(spec, request_id, cancel, deltas=deltas)
        self.scheduler.submit(job)
        return self._relay(job)

    def _run_locked(self, spec: Spec, request_id: str | None, cancel: threading.Event) -> Generator[dict, None, dict]:
        """``max_batch == 1``: the request decodes in the caller's thread once it holds the lock."""
        with self._count_lock:
            self._lock_waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._count_lock:
                self._lock_waiting -= 1
        try:
            if cancel.is_set():
                self.aborted += 1
                raise Cancelled("the client went away while waiting")
            self.refresh()
            return (yield from self._decode_one(self.decoder, spec, request_id, cancel))
        finally:
            self.lock.release()

    @staticmethod
    def _relay(job: Job) -> Generator[dict, None, dict]:
        """``max_batch > 1``: the events the scheduler's thread sends for ``job``."""
        try:
            while True:
                ev = job.events.get()
                if "error" in ev:
                    raise ev["error"]
                if "done" in ev:
                    return ev["done"]
                yield ev
        except GeneratorExit:
            job.cancel.set()
            raise

    def _decode_one(self, dec: SpeculativeDecoder, spec: Spec, request_id: str | None,
                    cancel: threading.Event | None = None) -> Generator[dict, None, dict]:
        """One request with the single-sequence decoder: yields the deltas, logs, returns the record; raises
        `Cancelled` at the first step after ``cancel`` is set."""
        dec.sampling = spec.sampling
        dec.processing = proc = spec.processing(self.target.vocab_size)
        started = time.time()
        try:
            state = dec.start(spec.prompt, spec.max_tokens)
        except ValueError as e:  # prompt too long for the context with this drafter's block
            raise BadRequest(str(e), "max_tokens") from None
        rng = TorchRandom(spec.seed)
        ts = TextStream(self.target.tokenizer, spec.stops)
        steps, sent_lp = [], 0
        try:
            while not state.done:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("the client went away")
                st = dec.step(state, rng)
                steps.append([st.accepted, st.attempted, st.drafted, st.emitted])
                out = state.tokens[state.prompt_len:]
                delta = ts.push(out, state.done)
                if delta or ts.stopped:
                    lps = proc.logprobs[sent_lp:len(out)] if proc is not None and proc.recording else []
                    sent_lp += len(lps)
                    yield {"delta": delta, "logprobs": lps}
                if ts.stopped:
                    break
        except (GeneratorExit, Cancelled):
            self.aborted += 1
            raise
        finally:
            dec.processing = None
        finish_hook = dec.caps.finish  # as SpeculativeDecoder.generate calls it (the hybrid's
        if finish_hook is not None and state.drafter_state is not None:  # running estimate carries over)
            finish_hook(dec, state)
        out = state.tokens[state.prompt_len:]
        finish = "stop" if ts.stopped or state.stop_reason == "eos" else "length"
        rec = self._finish(spec, out, ts.text, finish, steps, request_id, started, self.version, self.kind)
        rec["_logprobs"] = proc.logprobs[:len(out)] if proc is not None and proc.recording else None
        return rec

    def _finish(self, spec: Spec, out: list[int], text: str, finish: str, steps: list[list[int]],
                request_id: str | None, started: float, version: str | None, kind: str | None) -> dict:
        """The request's record, written to the log (without messages, prompt and text unless ``log_bodies``)."""
        now = time.time()
        record = make_record(request=spec.body, prompt_ids=spec.prompt, response_ids=out, response_text=text,
                             finish_reason=finish, target_name=self.target.name,
                             fingerprint=self.target.fingerprint, drafter_version=version, drafter_kind=kind,
                             steps=steps, request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}",
                             started=started, finished=now)
        if self.log is not None:
            if self.log_bodies:
                self.log.write(record)
            else:
                self.log.write({**record, "response_text": "",
                                "request": {k: v for k, v in spec.body.items() if k not in BODY_FIELDS}})
        if self.suffix_state_ is not None:  # exactly the logged responses: the index stays the log's
            self.suffix_state_.learn(out, record["id"])
        self.served += 1
        self.latency_s = 0.8 * self.latency_s + 0.2 * (now - started)
        return record

    def warmup(self, new_tokens: int = 4) -> float:
        """Decode a short prompt through each decoder the service uses, so that compiling the forward happens
        before the first request rather than in it; nothing is logged. Returns the seconds it took. Call it
        before serving (the batching thread is idle: nothing is queued)."""
        t0 = time.perf_counter()
        ids = [int(t) for t in self.target.tokenizer("Hello")["input_ids"]] or [min(self.target.eos_token_ids)]
        with self.lock:
            if self.batched is not None:  # in the cache a batched call allocates: each of the step's graphs
                self.batched.warmup(ids, new_tokens, self.max_batch, self.batch_positions)
            self.decoder.generate(ids, new_tokens)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ the scheduler (max_batch > 1)
    def start(self) -> None:
        """Start the batching thread (``max_batch > 1``; idempotent)."""
        if self.scheduler is not None:
            self.scheduler.start()

    def run_forever(self) -> None:
        """``max_batch > 1``: run the batching loop in the calling thread until `stop` (``draftsmith serve`` runs
        it in the main thread, with the HTTP server in another). Measured on a 2-core AVX2 EPYC, a compiled
        decode step called from a thread other than the process's first ran at half the speed it runs at from
        that first thread (13 against 25 tok/s, one row); the model's own forward showed no such difference."""
        if self.scheduler is None:
            raise RuntimeError("run_forever needs max_batch > 1 (max_batch 1 decodes in the request's thread)")
        self.scheduler.run_here()

    def stop(self) -> None:
        """Ask the batching loop to end after its current call, without waiting (safe in a signal handler)."""
        if self.scheduler is not None:
            self.scheduler.stop()

    def close(self, timeout: float | None = 30) -> None:
        """Stop the batching thread after its current call (requests still queued get an error); save the
        suffix index."""
        if self.scheduler is not None:
            self.scheduler.close(timeout)
        if self.save_suffix():
            log.info("suffix index saved to %s", self.suffix_state)

    def queued(self) -> int:
        """Requests waiting (for the batching thread, or for the lock)."""
        return self.scheduler.queued() if self.scheduler is not None else self._lock_waiting

    @property
    def batch_sizes(self) -> list[int]:
        """Rows every batched call started with, in order."""
        return self.scheduler.batch_sizes if self.scheduler is not None else []

    @property
    def admitted(self) -> int:
        """Requests that joined a running batched call (continuous batching)."""
        return self.scheduler.admitted if self.scheduler is not None else 0

    def batching(self) -> dict:
        """How the batching thread has batched so far (``/health``): calls and the rows they started with, rows
        admitted into running calls and in how many admissions (each one prefill forward), steps held for a
        group, the group size and hold limit."""
        sc = self.scheduler
        if sc is None:
            return {"max_batch": 1}
        return {"max_batch": self.max_batch, "calls": len(sc.batch_sizes), "rows_at_start": sum(sc.batch_sizes),
                "admitted": sc.admitted, "admissions": len(sc.admit_groups), "held_steps": sc.held_steps,
                "admit_group": sc.admit_group, "admit_hold_steps": sc.admit_hold_steps}

    @property
    def unbatched(self) -> int:
        """Requests the batching thread decoded one at a time (an unbatchable drafter)."""
        return self.scheduler.unbatched if self.scheduler is not None else 0

    @property
    def refused(self) -> int:
        """Requests refused with `QueueFull`."""
        return self.refused_lock + (self.scheduler.refused if self.scheduler is not None else 0)
