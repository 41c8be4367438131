"""A small OpenAI-compatible chat server on loopback, backed by a (tiny) target, for tests of remote data."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from draftsmith.train.data.generate import generate_batch, prompt_ids


def serve(target, model_name: str = "tiny"):
    """Start the server in a thread; returns (url, stop, counter of requests)."""
    lock = threading.Lock()
    seen = {"chat": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code, obj):
            b = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("model") != model_name:
                return self._send(404, {"error": f"model {body.get('model')!r} not found"})
            ids = prompt_ids(target.tokenizer, body["messages"])
            with lock:
                seen["chat"] += 1
                out, fin = generate_batch(target, [ids], int(body["max_tokens"]), float(body.get("temperature", 0)),
                                          float(body.get("top_p", 1.0)), seed=int(body.get("seed") or 0))[0]
            text = target.tokenizer.decode(out, skip_special_tokens=True)
            self._send(200, {"id": "x", "object": "chat.completion", "model": model_name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop" if fin else "length"}],
                             "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()

    def stop():
        srv.shutdown()
        srv.server_close()

    return f"http://127.0.0.1:{srv.server_address[1]}", stop, seen
