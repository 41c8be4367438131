"""The reference OpenAI-compatible server: FastAPI app around the lossless decoder.

Routes: ``POST /v1/chat/completions`` (``stream: true`` gives server-sent
events ending with ``data: [DONE]``) and ``GET /v1/models``. Every request is
decoded by `draftsmith.engine.decoder.SpeculativeDecoder` with the drafter
that is current in the publish directory (plain decoding when none is). The
decoder runs one generation at a time, so requests are served one after the
other under a lock; a newly published drafter is picked up when the lock is
taken for the next request, never during one, and a version that fails to
load leaves the previous one serving (logged). Every finished request is
written as one JSON line (`draftsmith.traffic`, schema in docs/online.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from draftsmith.checkpoint import read_manifest
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.drafters import drafter_from_checkpoint
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.tree_build import parse_tree
from draftsmith.publish import PublishStore, load_current
from draftsmith.target import Target
from draftsmith.traffic import TrafficLog, chat_prompt_ids, make_record

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""


class DecodingService:
    """One target, the current published drafter, one decoder, a request lock and the traffic log."""

    def __init__(self, target: Target, *, publish_dir: str | Path | None = None, log_dir: str | Path | None = None,
                 tree: str = "chain", model_name: str | None = None, max_log_bytes: int = 64 << 20,
                 default_max_tokens: int = 256):
        self.target = target
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
        self.swaps = 0
        self.served = 0
        self.refresh()

    def _load(self, path: Path):
        drafter = drafter_from_checkpoint(path, self.target)
        tree = parse_tree(self.tree_spec, path) if getattr(drafter, "supports_trees", True) else None
        return SpeculativeDecoder(self.target, drafter, tree=tree), read_manifest(path).get("kind")

    def refresh(self) -> None:
        """Switch to the published current drafter if it changed (call with the lock held or before serving)."""
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
        self.decoder, self.kind = loaded
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
        """Decode one request; yields ``{"delta": text, "ids": [...]}`` per step, then ``{"done": record}``.

        Holds the lock for the whole generation (released if the consumer stops early)."""
        prompt = self.prompt_ids(body)
        sp, max_tokens, seed = self.sampling(body)
        with self.lock:
            self.refresh()
            dec = self.decoder
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
            finish = "stop" if state.stop_reason == "eos" else "length"
            rid = request_id or f"chatcmpl-{uuid.uuid4().hex}"
            record = make_record(request=body, prompt_ids=prompt, response_ids=out,
                                 response_text=tok.decode(out, skip_special_tokens=True), finish_reason=finish,
                                 target_name=self.target.name, fingerprint=self.target.fingerprint,
                                 drafter_version=self.version, drafter_kind=self.kind, steps=steps,
                                 request_id=rid, started=started, finished=time.time())
            if self.log is not None:
                self.log.write(record)
            self.served += 1
        yield {"done": record}


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
