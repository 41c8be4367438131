"""The server's HTTP side: OpenAI-compatible routes over a `draftsmith.serve.service.DecodingService`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (text prompts), each streaming (server-sent
events ending with ``data: [DONE]``) or not, ``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health``.
Request bodies are the typed models of `draftsmith.serve.schema`: an unknown field, a field out of the API's
range, or a field this server does not implement is a 400 naming it, in OpenAI's error format (``{"error":
{"message", "type", "param", "code"}}``). Implemented beside temperature / top_p / max_tokens / seed / stop /
n=1: ``logprobs`` + ``top_logprobs``, ``frequency_penalty``, ``presence_penalty``, ``logit_bias``, vLLM's
``repetition_penalty``, ``top_k`` and ``min_p`` (all lossless: `draftsmith.engine.processors`),
``stream_options.include_usage``, ``echo`` (completions). ``usage`` is in every non-streaming response and in
the last chunk of a stream with ``include_usage``.

As a server a user exposes:
  * ``api_key``: every route but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise);
  * ``max_body_bytes``: a larger body is a 413 before it is parsed or tokenised (read no further than the
    limit);
  * a full queue is a 429 with ``Retry-After`` (`draftsmith.serve.scheduler.QueueFull`);
  * a client that goes away (disconnect, timeout; streaming or not) stops its request at the next step: a
    watcher polls the connection while the request waits or decodes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Any, Generator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from draftsmith.serve.request import BadRequest, Spec
from draftsmith.serve.scheduler import Cancelled, QueueFull
from draftsmith.serve.schema import ChatRequest, CompletionRequest, request_error
from draftsmith.serve.service import DecodingService

log = logging.getLogger("draftsmith.serve")

#: what a -inf log-probability is reported as (JSON has no infinity; vLLM's choice)
LOGPROB_FLOOR = -9999.0
#: how often (seconds) a request's watcher asks whether its client is still connected
WATCH_S = 0.25
#: the status a request whose client left is closed with (nginx's "client closed request"; nobody reads it)
CLIENT_GONE = 499


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


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _busy(e: QueueFull) -> JSONResponse:
    return _error(429, str(e), None, "queue_full", {"Retry-After": str(e.retry_after)})


async def _watch(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client goes away (run beside a request until it ends)."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(WATCH_S)


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None when it is over ``limit`` bytes (read no further than that)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        return None
    out = bytearray()
    async for chunk in request.stream():
        out += chunk
        if len(out) > limit:
            return None
    return bytes(out)


def create_app(service: DecodingService, *, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI application serving ``service``; ``api_key``: required on every route but ``/health``;
    ``max_body_bytes``: the largest request body (413 beyond)."""
    app = FastAPI(title="draftsmith serve")
    app.state.service = service
    fmt = _Formatter(service.target.tokenizer)
    want = None if not api_key else f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authorise(request: Request, call_next):
        if want is not None and request.url.path != "/health":
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                return _error(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'", None,
                              "invalid_api_key")
        return await call_next(request)

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
                "aborted": service.aborted, "refused": service.refused, "queued": service.queued(),
                "suffix": service.suffix_report(), "batching": service.batching()}

    async def parse(request: Request, schema) -> tuple[Any, Any]:
        """(spec, validated request) or (None, error response)."""
        raw = await _read_body(request, max_body_bytes)
        if raw is None:
            return None, _error(413, f"request body is over this server's limit of {max_body_bytes} bytes "
                                     f"(--max-body-mb)", None, "body_too_large")
        try:
            body = json.loads(raw)
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
        try:  # tokenising a long prompt takes a while: not on the event loop
            return (await run_in_threadpool(service.spec, req, body), req), None
        except BadRequest as e:
            return None, _error(400, str(e), e.param)

    async def collect(request: Request, spec: Spec, rid: str) -> Any:
        """A non-streaming request's record, or the error response (429 busy, 400, client gone)."""
        cancel = threading.Event()
        try:
            gen = service.run(spec, rid, cancel, deltas=False)
        except QueueFull as e:
            return _busy(e)

        def go():
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    return stop.value
        watcher = asyncio.create_task(_watch(request, cancel))
        try:
            return await run_in_threadpool(go)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except Cancelled:
            return Response(status_code=CLIENT_GONE)
        finally:
            watcher.cancel()

    def stream(request: Request, spec: Spec, rid: str, sse) -> Any:
        """A streaming request's response (429 before any event when the queue is full)."""
        cancel = threading.Event()
        try:
            gen = service.run(spec, rid, cancel)
        except QueueFull as e:
            return _busy(e)
        return StreamingResponse(_until_disconnected(request, sse(gen), cancel), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        parsed, err = await parse(request, ChatRequest)
        if err is not None:
            return err
        spec, req = parsed
        created = int(time.time())
        if req.stream:
            cid = f"chatcmpl-{uuid.uuid4().hex}"
            return stream(request, spec, cid, lambda gen: _chat_sse(service, fmt, gen, cid, spec, req, created))
        rec = await collect(request, spec, f"chatcmpl-{uuid.uuid4().hex}")
        if not isinstance(rec, dict):
            return rec
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
            cid = f"cmpl-{uuid.uuid4().hex}"
            return stream(request, spec, cid,
                          lambda gen: _completion_sse(service, fmt, gen, cid, spec, req, created, echo, echo_lps))
        rec = await collect(request, spec, f"cmpl-{uuid.uuid4().hex}")
        if not isinstance(rec, dict):
            return rec
        lps = rec.pop("_logprobs")
        return JSONResponse({
            "id": rec["id"], "object": "text_completion", "created": created,
            "model": service.model_name,
            "choices": [{"index": 0, "text": echo + rec["response_text"], "finish_reason": rec["finish_reason"],
                         "logprobs": None if lps is None else fmt.completion((echo_lps or []) + lps)}],
            "usage": _usage(rec), "draftsmith": _decoding_info(rec)})

    return app


async def _until_disconnected(request: Request, events: Generator[str, None, None], cancel: threading.Event):
    """Relay a synchronous event stream (each step decoded in a worker thread) until the client disconnects;
    then cancel and close it, which stops the request in the service (uvicorn drops writes to a closed
    connection silently, so without this the generation would run to its end). A watcher sets ``cancel`` while
    the request waits in the queue or between chunks."""
    watcher = asyncio.create_task(_watch(request, cancel))
    try:
        async for chunk in iterate_in_threadpool(events):
            if await request.is_disconnected():
                cancel.set()
                break
            yield chunk
    finally:
        watcher.cancel()
        try:
            events.close()  # suspended at a yield here: GeneratorExit reaches the service at once
        except ValueError:  # cancelled while a worker thread runs it: it is closed when collected
            log.warning("a stream was cancelled while decoding; it stops when collected")


def _events(gen: Generator[dict, None, dict]) -> Iterator[tuple[str, Any]]:
    """("delta", event) per step of a request's event generator (`DecodingService.run`), then ("done", record),
    or ("error", BadRequest); nothing more once its client is gone."""
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
    except Cancelled:
        return
    finally:
        gen.close()  # a client that left: the service stops this request


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chat_sse(service: DecodingService, fmt: _Formatter, gen, cid: str, spec: Spec, req: ChatRequest,
              created: int) -> Iterator[str]:
    """Server-sent events for a streaming chat request (run by Starlette in a worker thread)."""

    def chunk(delta: dict, finish: str | None = None, lps=None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": None if lps is None else {"content": fmt.chat(lps), "refusal": None}}
        return _sse_line({"id": cid, "object": "chat.completion.chunk", "created": created,
                          "model": service.model_name, "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    want = spec.top_logprobs is not None
    events = _events(gen)
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


def _completion_sse(service: DecodingService, fmt: _Formatter, gen, cid: str, spec: Spec, req: CompletionRequest,
                    created: int, echo: str, echo_lps=None) -> Iterator[str]:
    """Server-sent events for a streaming text completion."""
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
    events = _events(gen)
    try:
        yield from _relay(service, events, chunk, "text_completion", cid, created, req, want,
                          lambda text: text, "")
    finally:
        events.close()
    yield "data: [DONE]\n\n"
