"""``draftsmith serve``: the reference OpenAI-compatible server (FastAPI + uvicorn).

    draftsmith serve [--target NAME|DIR] [--publish DIR] [--logs DIR] [--host 127.0.0.1] [--port 8000]
                     [--tree chain] [--model-name NAME] [--max-log-mb 64] [--max-batch 8]
                     [--suffix [--suffix-state DIR] [--suffix-save-every 100] [--suffix-min-score 2 ...]]
                     [--api-key KEY] [--max-queue 256] [--max-body-mb 1] [--max-prompt-tokens N]
                     [--max-tokens-limit N] [--no-log-bodies] [--draft-max-rows N]

Serves ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming and not) and ``GET /v1/models``
on loopback unless ``--host`` says otherwise, decoding with the lossless decoder
and the drafter that is current in ``--publish`` (plain decoding while none is;
``draftsmith publish CKPT --to DIR`` checks a checkpoint and makes it current).
Writes one JSON line per finished request to rotating files in ``--logs``
(schema: docs/online.md). Concurrent requests are decoded together, up to
``--max-batch`` at a time, by the batched decoder (``--max-batch 1``: one request
at a time, under a lock).

``--suffix`` turns on SuffixDecoding: one global suffix index over every
logged response (shared by all requests, kept across drafter swaps) drafts
alone while nothing is published, and beside the published drafter (the
hybrid, one request at a time) otherwise. The index is saved to
``--suffix-state`` (default ``LOGS/suffix-index``) every
``--suffix-save-every`` responses and at shutdown, and loaded at start; a
missing or unusable state is rebuilt from the request logs. ``GET /health``
reports its size and memory.

Exposed beyond loopback, as vLLM's server is: ``--api-key`` (or ``DRAFTSMITH_API_KEY``) is required on every
route but ``/health`` (401 otherwise); at most ``--max-queue`` requests wait beyond the rows free in the running
batch (429 with Retry-After past it);
a body over ``--max-body-mb`` is a 413 before it is parsed; ``--max-prompt-tokens`` and ``--max-tokens-limit``
bound what one request may ask (400 naming the field); ``--no-log-bodies`` keeps messages, prompts and texts out
of the request log (token ids stay: the online job trains on them). A request whose client goes away stops at
the next step.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

import torch
import uvicorn

from draftsmith.cli.shared import add_dtype_arg, add_suffix_args, load_target_as, suffix_config
from draftsmith.engine.fastpath import add_forward_arg, use_fast_forward
from draftsmith.serve.app import DecodingService, create_app
from draftsmith.serve.scheduler import ADMIT_HOLD_STEPS
from draftsmith.target import default_device


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target name or directory")
    ap.add_argument("--publish", default=None, help="publish directory (versions/ + current) to take drafters from")
    ap.add_argument("--logs", default=None, help="directory for the request log (JSONL, rotating)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tree", default="chain", help="chain | built:BUDGET | dynamic[:B,D,W] | JSON paths")
    ap.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    ap.add_argument("--max-log-mb", type=float, default=64.0, help="rotate the request log at this size")
    ap.add_argument("--max-tokens", type=int, default=256, help="default max_tokens when a request sets none")
    ap.add_argument("--max-batch", type=int, default=8,
                    help="decode up to this many concurrent requests together (batched decoder); "
                         "1 = one request at a time under a lock")
    add_suffix_args(ap, "SuffixDecoding: draft from a global index of every served response (alone while no "
                        "drafter is published, else beside it: the hybrid)")
    ap.add_argument("--suffix-state", default=None, metavar="DIR",
                    help="SuffixDecoding: save the global index here and load it at start (default: "
                         "LOGS/suffix-index with --logs, else not saved); rebuilt from the logs when unusable")
    ap.add_argument("--suffix-save-every", type=int, default=100, metavar="N",
                    help="SuffixDecoding: save the index after every N indexed responses (0: at shutdown only)")
    ap.add_argument("--api-key", default=os.environ.get("DRAFTSMITH_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                         "$DRAFTSMITH_API_KEY; none: open to whoever reaches the port)")
    ap.add_argument("--admit-group", type=int, default=1, metavar="N",
                    help="while a batch decodes, hold waiting requests until N can join it together (one prefill "
                         "forward for all), for at most --admit-hold-steps steps (default: 1, no holding; worth "
                         "setting for long prompts, whose prefills are dear)")
    ap.add_argument("--admit-hold-steps", type=int, default=ADMIT_HOLD_STEPS, metavar="S",
                    help="steps a waiting request may be held for its admission group")
    ap.add_argument("--draft-max-rows", type=int, default=None, metavar="N",
                    help="batched decoding drafts only while at most N rows are live; wider steps are plain "
                         "(as vLLM's disable_by_batch_size; default: draft at every batch size)")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="requests that may wait beyond the running batch's free rows; past it a "
                         "request gets 429 with Retry-After")
    ap.add_argument("--max-body-mb", type=float, default=1.0, help="largest request body (413 beyond)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="longest prompt a request may send, in tokens (400 beyond; default: the context)")
    ap.add_argument("--max-tokens-limit", type=int, default=None,
                    help="largest max_tokens a request may ask for (400 beyond; default: the context)")
    ap.add_argument("--no-log-bodies", action="store_true",
                    help="leave messages, prompts and response texts out of the request log (ids stay)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_forward_arg(ap)
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip decoding a short prompt at start (then the first requests pay for compiling)")
    ap.add_argument("--device", default=None)
    add_dtype_arg(ap, "float32", "float32")
    return ap


def publish_hint(publish: str | None, tree: str, suffix: bool = False) -> str:
    """What `main` prints when no drafter is current: how to publish one."""
    where = publish or "DIR"
    now = "drafting with SuffixDecoding alone" if suffix else "decoding plainly"
    return (f"no drafter is current{' in ' + publish if publish else ''}: {now}. Publish one (checked "
            f"against the target first; picked up before the next request) with\n"
            f"    draftsmith publish CHECKPOINT --to {where} --tree {tree}"
            + ("" if publish else f"\nand restart with --publish {where}"))


def suffix_summary(report: dict) -> str:
    """What `main` prints at start with ``--suffix``: where the global index came from, its size and memory."""
    st = report["start"] or {}
    if st.get("source") == "state":
        origin = f"loaded from {st['dir']}"
    elif st.get("source") == "logs":
        origin = (f"rebuilt from the request logs ({st['reason']}): {st['used']} records used, {st['skipped']} "
                  f"skipped {st['skipped_by_reason']}")
    else:
        origin = f"empty ({st.get('reason', 'no state, no logs')})"
    every = f" and every {report['save_every']} responses" if report["save_every"] else " only"
    where = (f"saved to {report['state_dir']} at shutdown{every}" if report["state_dir"]
             else "not saved (no --suffix-state and no --logs)")
    return (f"SuffixDecoding: global index {origin}; {report['responses']} responses, {report['indexed_tokens']} "
            f"tokens, {report['bytes']} bytes (at most {report['max_cached_requests']} responses, FIFO); {where}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith serve``."""
    a = build_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target_as(a.target, a.dtype, default_device(a.device))
    use_fast_forward(target, a.forward)  # the single-sequence decoder's forward; batched plain steps follow it
    service = DecodingService(target, start=False, publish_dir=a.publish, log_dir=a.logs, tree=a.tree,
                              model_name=a.model_name,
                              max_log_bytes=int(a.max_log_mb * (1 << 20)), default_max_tokens=a.max_tokens,
                              max_batch=a.max_batch, suffix=suffix_config(a) if a.suffix else None,
                              suffix_state=a.suffix_state, suffix_save_every=a.suffix_save_every,
                              max_queue=a.max_queue, max_prompt_tokens=a.max_prompt_tokens,
                              max_tokens_limit=a.max_tokens_limit, log_bodies=not a.no_log_bodies,
                              admit_group=a.admit_group, admit_hold_steps=a.admit_hold_steps,
                              draft_max_rows=a.draft_max_rows)
    plain = "none (SuffixDecoding alone)" if a.suffix else "none (plain)"
    print(f"serving {service.model_name} ({target.fingerprint}) with drafter {service.version or plain} "
          f"on http://{a.host}:{a.port}/v1, up to {a.max_batch} request(s) per batch, {a.max_queue} waiting; "
          f"{'API key required' if a.api_key else 'no API key (anyone who reaches the port may use it)'}",
          flush=True)
    if a.suffix:
        print(suffix_summary(service.suffix_report()), flush=True)
    if not a.no_warmup:
        print(f"warm-up ({a.forward} forward) took {service.warmup():.1f} s", flush=True)
    if service.version is None:
        print(publish_hint(a.publish, a.tree, a.suffix), flush=True)
    app = create_app(service, api_key=a.api_key, max_body_bytes=int(a.max_body_mb * (1 << 20)))
    if a.max_batch == 1:  # requests decode in the server's worker threads, under the service's lock
        try:
            uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
        finally:
            service.close()
        return 0
    # the batching loop owns the model in this (the main) thread (`DecodingService.run_forever` says why); the
    # HTTP server runs in another, and either ending ends both
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level="warning"))

    def http():
        try:
            server.run()
        finally:
            service.stop()
    web = threading.Thread(target=http, name="draftsmith-http", daemon=True)

    def on_signal(signum, frame):
        server.should_exit = True
        service.stop()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    web.start()
    try:
        service.run_forever()
    finally:
        server.should_exit = True
        web.join(30)
        service.close()
    return 0
