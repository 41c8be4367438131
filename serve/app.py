"""The reference OpenAI-compatible server: FastAPI app around the lossless decoder.

Routes: ``POST /v1/chat/completions`` (``stream: true`` gives server-sent
events ending with ``data: [DONE]``) and ``GET /v1/models``. Every request is
decoded losslessly with the drafter that is current in the publish directory
(plain decoding when none is); a version that fails to load leaves the
previous one serving (logged). Every finished request is written as one JSON
line (`draftsmith.traffic`, schema in docs/online.md).

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

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from draftsmith.checkpoint import read_manifest
from draftsmith.engine.batched import BatchedSpeculativeDecoder, plain_batched_decoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.tree_build import parse_tree
from draftsmith.publish import PublishStore, load_current
from draftsmith.target import Target
from draftsmith.traffic import TrafficLog, chat_prompt_ids, make_record

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""


@dataclass(eq=False)
class _Job:
    """A queued request (``max_batch > 1``): what to decode, and the events its caller reads."""

    body: dict
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    seed: int | None
    request_id: str | None
    events: "queue.SimpleQueue[dict]" = field(default_factory=queue.SimpleQueue)
    ids: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    text: str = ""
    finished: bool = False


class DecodingService:
    """One target, the current published drafter, its decoders, a request lock or a batching queue, the log.

    ``max_batch``: 1 decodes one request at a time under a lock in the caller's thread; more queues requests
    for one batching thread (see the module docstring), started at once unless ``start=False`` (then call
    `start`; tests queue requests first to see them batched)."""

    def __init__(self, target: Target, *, publish_dir: str | Path | None = None, log_dir: str | Path | None = None,
                 tree: str = "chain", model_name: str | None = None, max_log_bytes: int = 64 << 20,
                 default_max_tokens: int = 256, max_batch: int = 1, start: bool = True):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
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
        self.batch_sizes: list[int] = []  # rows of every batched call, in order
        self.unbatched = 0  # requests decoded one at a time by the batching thread (unbatchable drafter)
        self._cv = threading.Condition()
        self._waiting: list[_Job] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.refresh()
        if max_batch > 1 and start:
            self.start()

    def _load(self, path: Path):
        drafter = drafter_from_checkpoint(path, self.target)
        tree = parse_tree(self.tree_spec, path) if getattr(drafter, "supports_trees", True) else None
        dec, kind = SpeculativeDecoder(self.target, drafter, tree=tree), read_manifest(path).get("kind")
        return dec, (self._batched_for(dec, path.name) if self.max_batch > 1 else None), kind

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
    def prompt_ids(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects with text content")
        return chat_prompt_ids(self.target.tokenizer, msgs)

    def sampling(self, body: dict) -> tuple[SamplingParams, int, int | None]:
        if body.get("n", 1) != 1:
            raise BadRequest("'n' must be 1 (one choice per request)")
        mt = body.get("max_completion_tokens", body.get("max_tokens", self.default_max_tokens))
        if not isinstance(mt, int) or mt < 1:
            raise BadRequest(f"'max_tokens' must be a positive integer, got {mt!r}")
        try:
            temp = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
            top_p = float(body.get("top_p", 1.0) if body.get("top_p") is not None else 1.0)
            sp = SamplingParams(temp, 0, top_p if temp > 0 else 1.0)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad sampling parameters: {e}") from None
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise BadRequest("'seed' must be an integer")
        return sp, mt, seed

    def run(self, body: dict, request_id: str | None = None) -> Iterator[dict]:
        """Decode one request; yields ``{"delta": text}`` per step, then ``{"done": record}``.

        ``max_batch == 1``: holds the lock for the whole generation (released if the consumer stops early).
        Otherwise the request is queued for the batching thread and its events are relayed (a consumer that
        stops early does not stop its row: the response is still decoded and logged)."""
        prompt = self.prompt_ids(body)
        sp, max_tokens, seed = self.sampling(body)
        if self.max_batch == 1:
            with self.lock:
                self.refresh()
                record = yield from self._decode_one(self.decoder, body, prompt, sp, max_tokens, seed, request_id)
            yield {"done": record}
            return
        job = _Job(body, prompt, sp, max_tokens, seed, request_id)
        with self._cv:
            if self._closed:
                raise RuntimeError("the decoding service is closed")
            self._waiting.append(job)
            self._cv.notify_all()
        while True:
            ev = job.events.get()
            if "error" in ev:
                raise ev["error"]
            yield ev
            if "done" in ev:
                return

    def _decode_one(self, dec: SpeculativeDecoder, body: dict, prompt: list[int], sp: SamplingParams,
                    max_tokens: int, seed: int | None, request_id: str | None) -> Generator[dict, None, dict]:
        """One request with the single-sequence decoder: yields the deltas, logs, returns the record."""
        dec.sampling = sp
        started = time.time()
        try:
            state = dec.start(prompt, max_tokens)
        except ValueError as e:  # prompt too long for the context
            raise BadRequest(str(e)) from None
        rng = TorchRandom(seed)
        tok = self.target.tokenizer
        text_so_far, steps = "", []
        while not state.done:
            st = dec.step(state, rng)
            steps.append([st.accepted, st.attempted, st.drafted, st.emitted])
            out = state.tokens[state.prompt_len:]
            text = tok.decode(out, skip_special_tokens=True)
            if text.endswith("\ufffd") and not state.done:  # an incomplete UTF-8 sequence: wait for the rest
                continue
            delta, text_so_far = text[len(text_so_far):], text
            yield {"delta": delta}
        out = state.tokens[state.prompt_len:]
        return self._finish(body, prompt, out, "stop" if state.stop_reason == "eos" else "length", steps,
                            request_id, started, self.version, self.kind)

    def _finish(self, body: dict, prompt: list[int], out: list[int], finish: str, steps: list[list[int]],
                request_id: str | None, started: float, version: str | None, kind: str | None) -> dict:
        """The request's record, written to the log."""
        record = make_record(request=body, prompt_ids=prompt, response_ids=out,
                             response_text=self.target.tokenizer.decode(out, skip_special_tokens=True),
                             finish_reason=finish, target_name=self.target.name,
                             fingerprint=self.target.fingerprint, drafter_version=version, drafter_kind=kind,
                             steps=steps, request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}",
                             started=started, finished=time.time())
        if self.log is not None:
            self.log.write(record)
        self.served += 1
        return record

    # ------------------------------------------------------------------ batching (max_batch > 1)
    def start(self) -> None:
        """Start the batching thread (``max_batch > 1``; idempotent)."""
        if self.max_batch > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="draftsmith-batcher", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 30) -> None:
        """Stop the batching thread after its current batch; requests still queued get an error."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def queued(self) -> int:
        """Requests waiting for the batching thread."""
        with self._cv:
            return len(self._waiting)

    def _take(self) -> list[_Job]:
        """The next batch: the oldest waiting request and the next waiting ones with the same sampling.

        The batched decoder takes one `SamplingParams` per call (temperature / top-k / top-p), but a random
        source per row, so requests are grouped by their sampling settings only (greedy requests always share
        a batch; seeds never split one). Requests with other settings stay queued, in order, for the next
        batch, so the oldest request is always in the next batch (no starvation). One request at a time when
        the current drafter cannot be batched."""
        with self._cv:
            first = self._waiting[0]
            n = self.max_batch if self.batched is not None else 1
            jobs = [j for j in self._waiting if j.sampling == first.sampling][:n]
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
        gen = self._decode_one(self.decoder, job.body, job.prompt, job.sampling, job.max_tokens, job.seed,
                               job.request_id)
        try:
            while True:
                job.events.put(next(gen))
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
                dec._rows([j.prompt], [j.max_tokens])
            except ValueError as e:  # prompt too long for the context
                j.finished = True
                j.events.put({"error": BadRequest(str(e).removeprefix("row 0: "))})
                continue
            ok.append(j)
        if not ok:
            return
        dec.sampling = ok[0].sampling
        version, kind, tok = self.version, self.kind, self.target.tokenizer
        self.batch_sizes.append(len(ok))
        started = time.time()

        def on_step(row: int, new_ids: list[int], st, stop: str | None) -> None:
            j = ok[row]
            j.ids.extend(new_ids)
            j.steps.append([st.accepted, st.attempted, st.drafted, st.emitted])
            text = tok.decode(j.ids, skip_special_tokens=True)
            if not (text.endswith("\ufffd") and stop is None):  # an incomplete UTF-8 sequence: wait for the rest
                delta, j.text = text[len(j.text):], text
                j.events.put({"delta": delta})
            if stop is not None:  # the row left the batch: its response is complete
                rec = self._finish(j.body, j.prompt, list(j.ids), "stop" if stop == "eos" else "length", j.steps,
                                   j.request_id, started, version, kind)
                j.finished = True
                j.events.put({"done": rec})

        dec.generate([j.prompt for j in ok], [j.max_tokens for j in ok], rngs=[TorchRandom(j.seed) for j in ok],
                     on_step=on_step)


def _usage(rec: dict) -> dict:
    p, c = len(rec["prompt_ids"]), len(rec["response_ids"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _decoding_info(rec: dict) -> dict:
    steps = rec["steps"] or []
    return {"drafter_version": rec["drafter"]["version"], "target_forwards": len(steps),
            "accepted": sum(s[0] for s in steps)}


def create_app(service: DecodingService) -> FastAPI:
    """The FastAPI application serving ``service``."""
    app = FastAPI(title="draftsmith serve")
    app.state.service = service

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "draftsmith", "drafter_version": service.version}]}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "drafter_version": service.version, "served": service.served}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HTTPException(400, "request body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != service.model_name:
            raise HTTPException(404, f"model {model!r} is not served here (serving {service.model_name!r})")
        try:  # validate before streaming starts, so a bad request is a 400, not a broken stream
            service.prompt_ids(body)
            service.sampling(body)
        except BadRequest as e:
            raise HTTPException(400, str(e)) from None
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(_sse(service, body, created), media_type="text/event-stream")
        from starlette.concurrency import run_in_threadpool  # the decoder blocks: keep the event loop free
        try:
            rec = await run_in_threadpool(lambda: [e for e in service.run(body) if "done" in e][0]["done"])
        except BadRequest as e:
            raise HTTPException(400, str(e)) from None
        return JSONResponse({
            "id": rec["id"], "object": "chat.completion", "created": created, "model": service.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": rec["response_text"]},
                         "finish_reason": rec["finish_reason"], "logprobs": None}],
            "usage": _usage(rec), "draftsmith": _decoding_info(rec)})

    return app


def _sse(service: DecodingService, body: dict, created: int) -> Iterator[str]:
    """Server-sent events for a streaming request (run by Starlette in a worker thread)."""
    cid = f"chatcmpl-{uuid.uuid4().hex}"

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": service.model_name,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    try:
        for ev in service.run(body, cid):
            if "done" in ev:
                rec = ev["done"]
                yield chunk({}, rec["finish_reason"], usage=_usage(rec), draftsmith=_decoding_info(rec))
            elif ev["delta"]:
                yield chunk({"content": ev["delta"]})
    except BadRequest as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
    yield "data: [DONE]\n\n"
