"""The reference OpenAI-compatible server: FastAPI app around the lossless decoder.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (text
prompts), each streaming (server-sent events ending with ``data: [DONE]``)
or not, ``GET /v1/models`` and ``GET /v1/models/{id}``. Request bodies are
the typed models of `draftsmith.serve.schema`: an unknown field, a field out
of the API's range, or a field this server does not implement is a 400
naming it, in OpenAI's error format (``{"error": {"message", "type",
"param", "code"}}``). Implemented beside temperature / top_p / max_tokens /
seed / stop / n=1: ``logprobs`` + ``top_logprobs``, ``frequency_penalty``,
``presence_penalty``, ``logit_bias``, vLLM's ``repetition_penalty``,
``top_k`` and ``min_p`` (all lossless: `draftsmith.engine.processors`),
``stream_options.include_usage``, ``echo`` (completions). ``usage`` is in
every non-streaming response and in the last chunk of a stream with
``include_usage``.

Every request is decoded losslessly with the drafter that is current in the
publish directory (plain decoding when none is); a version that fails to
load leaves the previous one serving (logged). Every answered request is
written as one JSON line (`draftsmith.traffic`, schema in docs/online.md); a
streaming request whose client disconnects is stopped and not logged
(counted in ``DecodingService.aborted``).

Two modes (``max_batch``):
  * ``max_batch == 1``: `draftsmith.engine.decoder.SpeculativeDecoder` runs one
    generation at a time in the request's own thread, under a lock; a newly
    published drafter is picked up when the lock is taken for the next
    request, never during one.
  * ``max_batch > 1``: requests are queued; one background thread (the only
    one that touches the model) takes up to ``max_batch`` waiting requests
    that can share a call and decodes them together with
    `draftsmith.engine.batched.BatchedSpeculativeDecoder`, streaming and
    logging each row as it commits and leaves (its ``on_step`` hook). A new
    drafter is picked up between batches only. A drafter the batched decoder
    refuses (self-drafters such as Kangaroo, dynamic trees, drafters with
    their own tokenizer, non-fixed draft lengths) is served one request at a
    time by the same thread with `SpeculativeDecoder` (logged when loaded).

SuffixDecoding (``suffix=SuffixConfig(...)``, ``draftsmith serve --suffix``):
one global `SuffixIndex` per service, shared by every request and kept across
drafter swaps, drafts alone while nothing is published and beside the
published drafter (`HybridDrafter`) otherwise. Every logged response is added
to it as it finishes (`_finish`, both modes; a cancelled request is neither
logged nor indexed), so the index is always the suffix index of the log. It is
saved to ``suffix_state`` every ``suffix_save_every`` indexed responses and at
`close`, and loaded at start; a missing, unreadable or other-target state is
rebuilt from the request logs instead (records used and skipped logged).
The hybrid runs in the single-sequence decoder only: with ``max_batch > 1``
its requests are served one at a time by the batching thread (logged when
loaded); SuffixDecoding alone is batched.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
import torch
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from draftsmith.checkpoint import drafter_from_checkpoint, read_manifest
from draftsmith.drafters.suffix import HybridDrafter, SuffixConfig, SuffixDrafter, SuffixIndex
from draftsmith.engine.batched import BatchedSpeculativeDecoder, plain_batched_decoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.processors import Penalties, RequestProcessing, TokenLogprob
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.tree_build import parse_tree
from draftsmith.publish import PublishStore, load_current
from draftsmith.serve.schema import ChatRequest, CompletionRequest, request_error
from draftsmith.target import Target
from draftsmith.traffic import TrafficLog, chat_prompt_ids, make_record

log = logging.getLogger(__name__)

#: what a -inf log-probability is reported as (JSON has no infinity; vLLM's choice)
LOGPROB_FLOOR = -9999.0


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Spec:
    """What to decode for one request, from its validated body."""

    body: dict  # the request as received (logged)
    kind: str  # "chat" | "completion"
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    seed: int | None
    penalties: Penalties
    top_logprobs: int | None  # None: no logprobs
    stops: list[str]

    def processing(self, vocab_size: int) -> RequestProcessing | None:
        if not self.penalties.active and self.top_logprobs is None:
            return None
        return RequestProcessing(self.penalties, vocab_size, self.top_logprobs)


class TextStream:
    """Incremental text of a response: holds back an incomplete UTF-8 character and any tail that could still
    grow into a stop sequence; cuts the text at the first stop sequence."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""
        self.text = ""
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> str:
        """The new text to send after the response grew to ``ids``; sets ``stopped`` at a stop sequence."""
        text = self.tok.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                return ""
            end = max(len(self.sent), end - self.hold)
        delta, self.sent = text[len(self.sent):end], text[:end]
        return delta


@dataclass(eq=False)
class _Job:
    """A queued request (``max_batch > 1``): what to decode, and the events its caller reads."""

    spec: Spec
    request_id: str | None
    stream: TextStream | None = None
    proc: RequestProcessing | None = None
    events: "queue.SimpleQueue[dict]" = field(default_factory=queue.SimpleQueue)
    ids: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    sent_logprobs: int = 0
    finished: bool = False
    cancelled: bool = False  # the client went away: stop the row, do not log it


class DecodingService:
    """One target, the current published drafter, its decoders, a request lock or a batching queue, the log.

    ``max_batch``: 1 decodes one request at a time under a lock in the caller's thread; more queues requests
    for one batching thread (see the module docstring), started at once unless ``start=False`` (then call
    `start`; tests queue requests first to see them batched).

    ``suffix``: SuffixDecoding's settings (None: off). ``suffix_state``: where its global index is saved and
    loaded (default ``log_dir/suffix-index`` when there is a log, else nowhere); ``suffix_save_every``: save
    after this many indexed responses (0: at `close` only)."""

    def __init__(self, target: Target, *, publish_dir: str | Path | None = None, log_dir: str | Path | None = None,
                 tree: str = "chain", model_name: str | None = None, max_log_bytes: int = 64 << 20,
                 default_max_tokens: int = 256, max_batch: int = 1, start: bool = True,
                 suffix: SuffixConfig | None = None, suffix_state: str | Path | None = None,
                 suffix_save_every: int = 100):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if suffix_save_every < 0:
            raise ValueError(f"suffix_save_every must be >= 0, got {suffix_save_every}")
        self.target = target
        self.max_batch = max_batch
        self.store = PublishStore(publish_dir) if publish_dir else None
        self.log = TrafficLog(log_dir, max_log_bytes) if log_dir else None
        self.tree_spec = tree
        self.model_name = model_name or target.name
        self.default_max_tokens = default_max_tokens
        self.lock = threading.Lock()
        self.version: str | None = None
        self.failed: str | None = None
        self.kind: str | None = None
        self.decoder = SpeculativeDecoder(target, None)
        # the batched decoder of the current drafter; None while it cannot be batched (one at a time)
        self.batched: BatchedSpeculativeDecoder | None = plain_batched_decoder(target) if max_batch > 1 else None
        self.swaps = 0
        self.served = 0
        self.aborted = 0  # requests stopped because their client disconnected (not logged)
        self.batch_sizes: list[int] = []  # rows of every batched call, in order
        self.unbatched = 0  # requests decoded one at a time by the batching thread (unbatchable drafter)
        self._cv = threading.Condition()
        self._waiting: list[_Job] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        # SuffixDecoding: one drafter (and global index) for the service's lifetime, whatever is published
        self.suffix: SuffixDrafter | None = None
        self.suffix_state = Path(suffix_state) if suffix_state else Path(log_dir) / "suffix-index" if log_dir else None
        self.suffix_save_every = suffix_save_every
        self.suffix_start: dict | None = None  # how the index was made at start (loaded, rebuilt, empty)
        self.suffix_saves = 0
        self._since_save = 0
        self._suffix_lock = threading.Lock()  # the index's writers and readers outside the decoding thread
        if suffix is not None:
            self.suffix = SuffixDrafter(suffix, self._start_index(suffix, log_dir), learn=False)  # we add (_finish)
            if self.suffix_start["source"] == "logs":  # a rebuilt index is saved at once: the next start loads it
                self.save_suffix()
            self.decoder = SpeculativeDecoder(target, self.suffix)
            self.batched = BatchedSpeculativeDecoder(target, self.suffix) if max_batch > 1 else None
            self.kind = "suffix"
        self.refresh()
        if max_batch > 1 and start:
            self.start()

    def _load(self, path: Path):
        drafter = drafter_from_checkpoint(path, self.target)
        tree = parse_tree(self.tree_spec, path) if getattr(drafter, "supports_trees", True) else None
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
            log.warning("drafter %s beside SuffixDecoding (the hybrid) runs in the single-sequence decoder only: "
                        "serving it one request at a time", path.name)
            return dec, None, kind
        return dec, self._batched_for(dec, path.name), kind

    # ------------------------------------------------------------------ SuffixDecoding's global index
    def _start_index(self, cfg: SuffixConfig, log_dir: str | Path | None) -> SuffixIndex:
        """The saved index if it loads for this target, else one rebuilt from the request logs, else empty.
        Never raises: a corrupt state or log costs the drafts it would have given, not the server."""
        fp, state = self.target.fingerprint, self.suffix_state
        why = "no saved state"
        if state is not None and (state / "suffix_index.json").exists():
            try:
                index = SuffixIndex.load(state, cfg, fingerprint=fp)
            except Exception as e:  # noqa: BLE001 (unreadable, torn, another target's: rebuild instead)
                why = f"saved state in {state} unusable: {e}"
                log.warning("suffix index: %s", why)
            else:
                self.suffix_start = {"source": "state", "dir": str(state), "responses": len(index)}
                log.info("suffix index loaded from %s: %d responses", state, len(index))
                return index
        if log_dir is None:
            self.suffix_start = {"source": "empty", "reason": why}
            return SuffixIndex(cfg)
        try:
            index, counts = SuffixIndex.rebuild_from_logs(log_dir, fp, vocab_size=self.target.vocab_size,
                                                          max_tokens=self.target.context_length, config=cfg)
        except Exception as e:  # noqa: BLE001 (an unreadable log directory: start empty rather than not at all)
            log.error("suffix index: could not rebuild from the request logs in %s (%s): starting empty", log_dir, e)
            self.suffix_start = {"source": "empty", "reason": f"{why}; logs unreadable: {e}"}
            return SuffixIndex(cfg)
        skipped = sum(counts["skipped"].values())
        self.suffix_start = {"source": "logs", "reason": why, "used": counts["used"], "skipped": skipped,
                             "skipped_by_reason": counts["skipped"], "responses": len(index)}
        log.log(logging.WARNING if skipped or why != "no saved state" else logging.INFO,
                "suffix index rebuilt from the request logs in %s (%s): %d records used, %d skipped %s",
                log_dir, why, counts["used"], skipped, counts["skipped"])
        return index

    def _learn(self, response: list[int], request_id: str) -> None:
        """Index a finished response in the global index; save it every ``suffix_save_every`` responses."""
        with self._suffix_lock:
            self.suffix.index.add_response(response, request_id)
            self._since_save += 1
            due = self.suffix_save_every > 0 and self._since_save >= self.suffix_save_every
        if due:
            self.save_suffix()

    def save_suffix(self) -> bool:
        """Save the global index to ``suffix_state`` (temporary files renamed); False when there is nothing to
        save it to or saving failed (logged: the server goes on)."""
        if self.suffix is None or self.suffix_state is None:
            return False
        with self._suffix_lock:
            try:
                self.suffix.index.save(self.suffix_state, self.target.fingerprint)
            except Exception as e:  # noqa: BLE001 (a full disk must not fail the request that triggered it)
                log.error("could not save the suffix index to %s: %s", self.suffix_state, e)
                self._since_save = 0  # retried after the next suffix_save_every responses, not on every one
                return False
            self._since_save = 0
            self.suffix_saves += 1
        return True

    def suffix_report(self) -> dict | None:
        """The global index's memory report, where it is saved and how it was made at start (None: off)."""
        if self.suffix is None:
            return None
        with self._suffix_lock:
            rep = self.suffix.index.memory_report()
        return {**rep, "state_dir": None if self.suffix_state is None else str(self.suffix_state),
                "save_every": self.suffix_save_every, "saves": self.suffix_saves,
                "start": self.suffix_start}

    def _batched_for(self, dec: SpeculativeDecoder, version: str) -> BatchedSpeculativeDecoder | None:
        """The batched decoder drafting exactly as ``dec`` does (same drafter, tree, fixed K), or None."""
        try:
            if dec.tree is None and not isinstance(dec.policy, FixedLength):
                raise ValueError(f"its draft length policy ({type(dec.policy).__name__}) is per sequence")
            return BatchedSpeculativeDecoder(self.target, dec.drafter, tree=dec.tree, k=dec.policy.max_len)
        except Exception as e:  # noqa: BLE001 (any refusal: serve it one request at a time rather than fail)
            log.warning("drafter %s cannot be batched (%s): serving it one request at a time", version, e)
            return None

    def refresh(self) -> None:
        """Switch to the published current drafter if it changed (call with the lock held, from the batching
        thread between batches, or before serving)."""
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
        max_tokens = req.max_new(self.default_max_tokens)
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

    def run(self, spec: Spec, request_id: str | None = None) -> Iterator[dict]:
        """Decode one request; yields ``{"delta": text, "logprobs": [...]}`` as the response grows, then
        ``{"done": record, "logprobs": [...]}``.

        ``max_batch == 1``: holds the lock for the whole generation (a consumer that stops early stops the
        generation: nothing is logged). Otherwise the request is queued for the batching thread and its events
        are relayed (a consumer that stops early ends its row at the next step, not logged)."""
        if self.max_batch == 1:
            with self.lock:
                self.refresh()
                record = yield from self._decode_one(self.decoder, spec, request_id)
            return record
        job = _Job(spec, request_id)
        with self._cv:
            if self._closed:
                raise RuntimeError("the decoding service is closed")
            self._waiting.append(job)
            self._cv.notify_all()
        try:
            while True:
                ev = job.events.get()
                if "error" in ev:
                    raise ev["error"]
                if "done" in ev:
                    return ev["done"]
                yield ev
        except GeneratorExit:
            job.cancelled = True
            raise

    def _decode_one(self, dec: SpeculativeDecoder, spec: Spec, request_id: str | None) -> Generator[dict, None, dict]:
        """One request with the single-sequence decoder: yields the deltas, logs, returns the record."""
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
        except GeneratorExit:
            self.aborted += 1
            raise
        finally:
            dec.processing = None
        finish_hook = getattr(dec.drafter, "finish", None)  # as SpeculativeDecoder.generate calls it (the hybrid's
        if finish_hook is not None and state.drafter_state is not None:  # running estimate carries over)
            finish_hook(dec, state)
        out = state.tokens[state.prompt_len:]
        finish = "stop" if ts.stopped or state.stop_reason == "eos" else "length"
        rec = self._finish(spec, out, ts.text, finish, steps, request_id, started, self.version, self.kind)
        rec["_logprobs"] = proc.logprobs[:len(out)] if proc is not None and proc.recording else None
        return rec

    def _finish(self, spec: Spec, out: list[int], text: str, finish: str, steps: list[list[int]],
                request_id: str | None, started: float, version: str | None, kind: str | None) -> dict:
        """The request's record, written to the log."""
        record = make_record(request=spec.body, prompt_ids=spec.prompt, response_ids=out, response_text=text,
                             finish_reason=finish, target_name=self.target.name,
                             fingerprint=self.target.fingerprint, drafter_version=version, drafter_kind=kind,
                             steps=steps, request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}",
                             started=started, finished=time.time())
        if self.log is not None:
            self.log.write(record)
        if self.suffix is not None:  # exactly the logged responses: the index stays the suffix index of the log
            self._learn(out, record["id"])
        self.served += 1
        return record

    # ------------------------------------------------------------------ batching (max_batch > 1)
    def start(self) -> None:
        """Start the batching thread (``max_batch > 1``; idempotent)."""
        if self.max_batch > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="draftsmith-batcher", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 30) -> None:
        """Stop the batching thread after its current batch (requests still queued get an error); save the
        suffix index."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.save_suffix():
            log.info("suffix index saved to %s", self.suffix_state)

    def queued(self) -> int:
        """Requests waiting for the batching thread."""
        with self._cv:
            return len(self._waiting)

    def _take(self) -> list[_Job]:
        """The next batch: the oldest waiting request and the next waiting ones with the same sampling.

        The batched decoder takes one `SamplingParams` per call (temperature / top-k / top-p / min-p), but a
        random source and logits processing per row, so requests are grouped by their sampling settings only
        (greedy requests always share a batch; seeds and penalties never split one). Requests with other
        settings stay queued, in order, for the next batch, so the oldest request is always in the next batch
        (no starvation). Requests whose client left while queued are dropped. One request at a time when the
        current drafter cannot be batched."""
        with self._cv:
            gone = [j for j in self._waiting if j.cancelled]
            self.aborted += len(gone)
            self._waiting = [j for j in self._waiting if not j.cancelled]
            if not self._waiting:
                return []
            first = self._waiting[0]
            n = self.max_batch if self.batched is not None else 1
            jobs = [j for j in self._waiting if j.spec.sampling == first.spec.sampling][:n]
            self._waiting = [j for j in self._waiting if all(j is not b for b in jobs)]
            return jobs

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    pending, self._waiting = self._waiting, []
                    break
            self.refresh()  # only here, between batches: a swap never lands inside one
            jobs = self._take()
            if not jobs:
                continue
            try:
                if self.batched is None:
                    self._run_single(jobs[0])
                else:
                    self._run_batch(self.batched, jobs)
            except Exception as e:  # noqa: BLE001 (the thread must survive; the callers get the error)
                log.exception("decoding a batch of %d requests failed", len(jobs))
                for j in jobs:
                    if not j.finished:
                        j.finished = True
                        j.events.put({"error": e})
        for j in pending:
            j.events.put({"error": RuntimeError("the decoding service was closed")})

    def _run_single(self, job: _Job) -> None:
        self.unbatched += 1
        gen = self._decode_one(self.decoder, job.spec, job.request_id)
        try:
            while True:
                ev = next(gen)
                job.events.put(ev)
                if job.cancelled:
                    gen.close()  # counted as aborted there
                    job.finished = True
                    return
        except StopIteration as stop:
            job.finished = True
            job.events.put({"done": stop.value})
        except BadRequest as e:
            job.finished = True
            job.events.put({"error": e})

    def _run_batch(self, dec: BatchedSpeculativeDecoder, jobs: list[_Job]) -> None:
        ok = []
        for j in jobs:  # the decoder's own per-row checks, one row at a time: a bad request fails alone
            try:
                dec._rows([j.spec.prompt], [j.spec.max_tokens])
            except ValueError as e:  # prompt too long for the context
                j.finished = True
                j.events.put({"error": BadRequest(str(e).removeprefix("row 0: "), "max_tokens")})
                continue
            ok.append(j)
        if not ok:
            return
        dec.sampling = ok[0].spec.sampling
        version, kind, tok = self.version, self.kind, self.target.tokenizer
        self.batch_sizes.append(len(ok))
        started = time.time()
        for j in ok:
            j.stream = TextStream(tok, j.spec.stops)
            j.proc = j.spec.processing(self.target.vocab_size)

        def on_step(row: int, new_ids: list[int], st, stop: str | None) -> bool:
            j = ok[row]
            if j.cancelled:  # the client left: end the row now, nothing logged
                j.finished = True
                self.aborted += 1
                return True
            j.ids.extend(new_ids)
            j.steps.append([st.accepted, st.attempted, st.drafted, st.emitted])
            delta = j.stream.push(j.ids, stop is not None)
            lps = []
            if j.proc is not None and j.proc.recording:
                lps = j.proc.logprobs[j.sent_logprobs:len(j.ids)]
            if delta or j.stream.stopped:
                j.sent_logprobs += len(lps)
                j.events.put({"delta": delta, "logprobs": lps})
            if stop is not None or j.stream.stopped:  # the row leaves the batch: its response is complete
                finish = "stop" if j.stream.stopped or stop == "eos" else "length"
                rec = self._finish(j.spec, list(j.ids), j.stream.text, finish, j.steps, j.request_id, started,
                                   version, kind)
                rec["_logprobs"] = j.proc.logprobs[:len(j.ids)] if j.proc is not None and j.proc.recording else None
                j.finished = True
                j.events.put({"done": rec})
                return j.stream.stopped
            return False

        dec.generate([j.spec.prompt for j in ok], [j.spec.max_tokens for j in ok],
                     rngs=[TorchRandom(j.spec.seed) for j in ok], on_step=on_step,
                     processing=[j.proc for j in ok])


# ---------------------------------------------------------------------- responses
def _usage(rec: dict) -> dict:
    p, c = len(rec["prompt_ids"]), len(rec["response_ids"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _decoding_info(rec: dict) -> dict:
    steps = rec["steps"] or []
    return {"drafter_version": rec["drafter"]["version"], "target_forwards": len(steps),
            "accepted": sum(s[0] for s in steps)}


def _lp(x: float | None) -> float | None:
    return None if x is None else max(float(x), LOGPROB_FLOOR)


class _Formatter:
    """Token strings and the two logprob formats (chat: ``content`` entries; completions: parallel lists)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def token(self, t: int) -> str:
        return self.tok.decode([t])

    def chat(self, lps) -> list[dict]:
        out = []
        for x in lps:
            s = self.token(x.token)
            out.append({"token": s, "logprob": _lp(x.logprob), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": self.token(i), "logprob": _lp(v),
                                          "bytes": list(self.token(i).encode("utf-8"))} for i, v in x.top]})
        return out

    def completion(self, lps, offset: int = 0) -> dict:
        tokens, tlp, top, offs = [], [], [], []
        for x in lps:
            s = self.token(x.token)
            tokens.append(s)
            tlp.append(_lp(x.logprob))
            if x.logprob is None:  # the first prompt token (echo): nothing to predict it from
                top.append(None)
            else:
                alts = {self.token(i): _lp(v) for i, v in x.top}
                alts.setdefault(s, _lp(x.logprob))
                top.append(alts)
            offs.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "invalid_request_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def create_app(service: DecodingService) -> FastAPI:
    """The FastAPI application serving ``service``."""
    app = FastAPI(title="draftsmith serve")
    app.state.service = service
    fmt = _Formatter(service.target.tokenizer)

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "draftsmith",
                "drafter_version": service.version}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    def model(model_id: str) -> Any:
        if model_id != service.model_name:
            return _error(404, f"The model {model_id!r} does not exist (serving {service.model_name!r})",
                          "model", "model_not_found")
        return model_card()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "drafter_version": service.version, "served": service.served,
                "aborted": service.aborted, "suffix": service.suffix_report()}

    async def parse(request: Request, schema) -> tuple[Any, Any]:
        """(spec, validated request) or (None, error response)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return None, _error(400, "request body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            msg, param = request_error(e)
            return None, _error(400, msg, param)
        if req.model is not None and req.model != service.model_name:
            return None, _error(404, f"The model {req.model!r} does not exist (serving {service.model_name!r})",
                                "model", "model_not_found")
        try:
            return (service.spec(req, body), req), None
        except BadRequest as e:
            return None, _error(400, str(e), e.param)

    async def collect(spec: Spec, rid: str) -> dict:
        def go():
            gen = service.run(spec, rid)
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    return stop.value
        return await run_in_threadpool(go)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        parsed, err = await parse(request, ChatRequest)
        if err is not None:
            return err
        spec, req = parsed
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_until_disconnected(request, _chat_sse(service, fmt, spec, req, created)),
                                     media_type="text/event-stream")
        try:
            rec = await collect(spec, f"chatcmpl-{uuid.uuid4().hex}")
        except BadRequest as e:
            return _error(400, str(e), e.param)
        lps = rec.pop("_logprobs")
        return JSONResponse({
            "id": rec["id"], "object": "chat.completion", "created": created, "model": service.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": rec["response_text"]},
                         "finish_reason": rec["finish_reason"],
                         "logprobs": None if lps is None else {"content": fmt.chat(lps), "refusal": None}}],
            "usage": _usage(rec), "draftsmith": _decoding_info(rec)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        parsed, err = await parse(request, CompletionRequest)
        if err is not None:
            return err
        spec, req = parsed
        created = int(time.time())
        echo = service.target.tokenizer.decode(spec.prompt, skip_special_tokens=True) if req.echo else ""
        echo_lps = None
        if req.echo and spec.top_logprobs is not None:
            echo_lps = await run_in_threadpool(service.prompt_logprobs, spec)
        if req.stream:
            return StreamingResponse(_until_disconnected(request, _completion_sse(service, fmt, spec, req, created,
                                                                                  echo, echo_lps)),
                                     media_type="text/event-stream")
        try:
            rec = await collect(spec, f"cmpl-{uuid.uuid4().hex}")
        except BadRequest as e:
            return _error(400, str(e), e.param)
        lps = rec.pop("_logprobs")
        return JSONResponse({
            "id": rec["id"], "object": "text_completion", "created": created,
            "model": service.model_name,
            "choices": [{"index": 0, "text": echo + rec["response_text"], "finish_reason": rec["finish_reason"],
                         "logprobs": None if lps is None else fmt.completion((echo_lps or []) + lps)}],
            "usage": _usage(rec), "draftsmith": _decoding_info(rec)})

    return app


async def _until_disconnected(request: Request, events: Generator[str, None, None]):
    """Relay a synchronous event stream (each step decoded in a worker thread) until the client disconnects;
    then close it, which stops the request in the service (uvicorn drops writes to a closed connection
    silently, so without this check the generation would run to its end)."""
    try:
        async for chunk in iterate_in_threadpool(events):
            if await request.is_disconnected():
                break
            yield chunk
    finally:
        try:
            events.close()  # suspended at a yield here: GeneratorExit reaches the service at once
        except ValueError:  # cancelled while a worker thread runs it: it is closed when collected
            log.warning("a stream was cancelled while decoding; it stops when collected")


def _events(service: DecodingService, spec: Spec, rid: str) -> Iterator[tuple[str, Any]]:
    """("delta", event) per step, then ("done", record), or ("error", BadRequest)."""
    gen = service.run(spec, rid)
    try:
        while True:
            try:
                ev = next(gen)
            except StopIteration as stop:
                yield "done", stop.value
                return
            yield "delta", ev
    except BadRequest as e:
        yield "error", e
    finally:
        gen.close()  # a client that left: the service stops this request


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chat_sse(service: DecodingService, fmt: _Formatter, spec: Spec, req: ChatRequest, created: int) -> Iterator[str]:
    """Server-sent events for a streaming chat request (run by Starlette in a worker thread)."""
    cid = f"chatcmpl-{uuid.uuid4().hex}"

    def chunk(delta: dict, finish: str | None = None, lps=None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": None if lps is None else {"content": fmt.chat(lps), "refusal": None}}
        return _sse_line({"id": cid, "object": "chat.completion.chunk", "created": created,
                          "model": service.model_name, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    want = spec.top_logprobs is not None
    events = _events(service, spec, cid)
    try:
        yield from _relay(service, events, chunk, "chat.completion.chunk", cid, created, req, want,
                          lambda text: {"content": text}, {})
    finally:
        events.close()
    yield "data: [DONE]\n\n"


def _relay(service, events, chunk, obj: str, cid, created, req, want, content, ended) -> Iterator[str]:
    """The SSE lines of one request's decoding events: ``content(text)`` makes a text delta's first argument to
    ``chunk``, ``ended`` the finishing chunk's; usage after it when the request asked (object type ``obj``)."""
    for what, ev in events:
        if what == "error":
            yield _sse_line({"error": {"message": str(ev), "type": "invalid_request_error", "param": ev.param,
                                       "code": None}})
            break
        if what == "delta":
            if ev["delta"] or ev["logprobs"]:
                yield chunk(content(ev["delta"]), lps=ev["logprobs"] if want else None)
            continue
        rec = ev
        yield chunk(ended, rec["finish_reason"])
        if req.include_usage:
            yield _sse_line({"id": cid, "object": obj, "created": created, "model": service.model_name,
                             "choices": [], "usage": _usage(rec), "draftsmith": _decoding_info(rec)})


def _completion_sse(service: DecodingService, fmt: _Formatter, spec: Spec, req: CompletionRequest, created: int,
                    echo: str, echo_lps=None) -> Iterator[str]:
    """Server-sent events for a streaming text completion."""
    cid = f"cmpl-{uuid.uuid4().hex}"
    offset = 0

    def chunk(text: str, finish: str | None = None, lps=None) -> str:
        nonlocal offset
        lp = None
        if lps is not None:
            lp = fmt.completion(lps, offset)
            offset += sum(len(t) for t in lp["tokens"])
        return _sse_line({"id": cid, "object": "text_completion", "created": created, "model": service.model_name,
                          "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]})

    if echo:
        yield chunk(echo, lps=echo_lps)
    offset = len(echo)
    want = spec.top_logprobs is not None
    events = _events(service, spec, cid)
    try:
        yield from _relay(service, events, chunk, "text_completion", cid, created, req, want,
                          lambda text: text, "")
    finally:
        events.close()
    yield "data: [DONE]\n\n"
