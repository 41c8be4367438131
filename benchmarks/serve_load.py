"""Load on ``draftsmith serve``: concurrent clients with mixed requests, mid-stream disconnects, then checks.

Starts ``draftsmith serve`` as its own process (``--publish``, ``--tree``, ``--max-batch``, a fresh log
directory), then ``--clients`` client threads send requests back to back for ``--duration`` seconds, each
drawn from a seeded mix: chat or text completion, streaming or not, ``max_tokens`` in {16, 48, 96}, greedy
or sampled (T=0.8 with a seed, or T=0.7 with top_p 0.9) or greedy with a frequency penalty, over
``--prompts`` MT-Bench questions; ``--disconnect`` of the streaming requests read a few chunks and close the
connection. Afterwards:
  * every greedy answer is compared with the same request served alone (``--alone`` distinct greedy
    requests, chosen at random, re-sent one at a time to the idle server);
  * log lines are counted against answered requests (a disconnected request is stopped and not logged);
  * the server's RSS is sampled every ``--rss-every`` seconds (peak, first and last minute).
Reports requests, failures, p50/p99 latency, completion tokens/s, disconnects, log lines vs answers, RSS.

    OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.serve_load --publish runs/pub --tree built:4 \\
        --clients 32 --duration 600 --out runs/load32
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import add_common_args, free_port, parser, setup, write_json
from draftsmith.eval.mtbench import mtbench_questions_path
from draftsmith.target import cpu_name


def _questions(n: int) -> list[str]:
    rows = [json.loads(x) for x in mtbench_questions_path().read_text().splitlines() if x.strip()]
    return [r["turns"][0] for r in rows[:: max(1, len(rows) // n)][:n]]


def make_request(rng: random.Random, prompts: list[str], model: str) -> dict:
    """One request of the mix: {"route", "body", "greedy", "key"} (key: what must give the same greedy text)."""
    i = rng.randrange(len(prompts))
    chat = rng.random() < 0.7
    n = rng.choice([16, 48, 96])
    mode = rng.choice(["greedy", "greedy", "penalty", "t0.8", "topp"])
    body: dict = {"model": model, "max_tokens": n}
    if chat:
        body["messages"] = [{"role": "user", "content": prompts[i]}]
    else:
        body["prompt"] = prompts[i]
    if mode == "greedy":
        body["temperature"] = 0
    elif mode == "penalty":
        body.update(temperature=0, frequency_penalty=0.5, logit_bias={"30": -5})
    elif mode == "t0.8":
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    else:
        body.update(temperature=0.7, top_p=0.9, seed=rng.randrange(1 << 30))
    body["stream"] = rng.random() < 0.5
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    key = json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, sort_keys=True)
    return {"route": "chat" if chat else "completion", "body": body, "greedy": body["temperature"] == 0, "key": key}


def send(client: httpx.Client, base: str, req: dict, disconnect_after: int | None = None) -> dict:
    """Send one request; returns status, latency, text, completion tokens, id, whether it disconnected."""
    path = "/v1/chat/completions" if req["route"] == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    out = {"route": req["route"], "greedy": req["greedy"], "key": req["key"], "stream": req["body"]["stream"]}
    try:
        if not req["body"]["stream"]:
            r = client.post(base + path, json=req["body"])
            out["status"] = r.status_code
            if r.status_code == 200:
                j = r.json()
                ch = j["choices"][0]
                out.update(text=ch["message"]["content"] if req["route"] == "chat" else ch["text"],
                           tokens=j["usage"]["completion_tokens"], id=j["id"])
            else:
                out["error"] = r.text[:200]
        else:
            with client.stream("POST", base + path, json=req["body"]) as r:
                out["status"] = r.status_code
                text, tokens, seen, rid = [], None, 0, None
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    c = json.loads(line[6:])
                    rid = c.get("id", rid)
                    if c.get("choices"):
                        ch = c["choices"][0]
                        text.append((ch["delta"].get("content") or "") if req["route"] == "chat" else ch["text"])
                    if c.get("usage"):
                        tokens = c["usage"]["completion_tokens"]
                    if "error" in c:
                        out["error"] = str(c["error"])[:200]
                    seen += 1
                    if disconnect_after is not None and seen >= disconnect_after:
                        out["disconnected"] = True
                        break  # leaving the with-block closes the connection mid-stream
                out.update(text="".join(text), tokens=tokens, id=rid)
                if out.get("disconnected"):
                    out["tokens"] = None
    except httpx.HTTPError as e:
        out["status"], out["error"] = -1, repr(e)[:200]
    out["latency_s"] = time.perf_counter() - t0
    return out


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = parser("serve_load", __doc__)
    ap.add_argument("--publish", default=None)
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--disconnect", type=float, default=0.15, help="share of streaming requests cut mid-stream")
    ap.add_argument("--alone", type=int, default=30, help="distinct greedy requests re-sent alone")
    ap.add_argument("--rss-every", type=float, default=5.0)
    add_common_args(ap, threads=True, threads_default=1, seed=True)
    b = setup(ap.parse_args(argv), load=False)
    a, out = b.args, b.out
    logs = out / "logs"
    if logs.exists():
        for f in logs.glob("*.jsonl"):
            f.unlink()
    port = free_port()
    cmd = [sys.executable, "-m", "draftsmith.cli", "serve", "--target", a.target, "--port", str(port),
           "--tree", a.tree, "--max-batch", str(a.max_batch), "--logs", str(logs), "--threads", str(a.threads)]
    if a.publish:
        cmd += ["--publish", a.publish]
    server_log = open(out / "server.log", "w")
    srv = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                models = httpx.get(base + "/v1/models", timeout=5).json()
                break
            except (httpx.HTTPError, ValueError):
                time.sleep(1)
        else:
            raise RuntimeError("the server did not start; see server.log")
        model = models["data"][0]["id"]
        prompts = _questions(a.prompts)
        rss: list[tuple[float, int]] = []
        results: list[dict] = []
        lock = threading.Lock()
        stop_at = time.time() + a.duration
        t_start = time.time()

        clients_done = threading.Event()

        def sampler():  # until the last client's last request has finished
            while not clients_done.is_set():
                v = rss_kb(srv.pid)
                if v:
                    rss.append((time.time() - t_start, v))
                time.sleep(a.rss_every)

        def client(k: int):
            rng = random.Random(a.seed * 1000 + k)
            with httpx.Client(timeout=600) as c:
                while time.time() < stop_at:
                    req = make_request(rng, prompts, model)
                    cut = rng.randint(2, 6) if req["body"]["stream"] and rng.random() < a.disconnect else None
                    r = send(c, base, req, cut)
                    with lock:
                        results.append(r)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
        watcher = threading.Thread(target=sampler)
        for t in threads + [watcher]:
            t.start()
        for t in threads:
            t.join()
        clients_done.set()
        watcher.join()
        wall = time.time() - t_start
        time.sleep(2)  # rows of disconnected clients end at their next step
        health = httpx.get(base + "/health", timeout=30).json()
        # every greedy answer against the same request served alone
        greedy = [r for r in results if r["greedy"] and r.get("status") == 200 and not r.get("disconnected")]
        keys = sorted({r["key"] for r in greedy})
        random.Random(a.seed).shuffle(keys)
        checked = keys[: a.alone]
        alone = {}
        with httpx.Client(timeout=600) as c:
            for key in checked:
                body = json.loads(key)
                route = "chat" if "messages" in body else "completion"
                alone[key] = send(c, base, {"route": route, "body": {**body, "stream": False}, "greedy": True,
                                            "key": key})["text"]
        compared = [r for r in greedy if r["key"] in alone]
        mismatched = [r for r in compared if r["text"] != alone[r["key"]]]
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    lines = [json.loads(x) for f in sorted(logs.glob("*.jsonl")) for x in f.read_text().splitlines()]
    answered = [r for r in results if r.get("status") == 200 and not r.get("disconnected") and "error" not in r]
    per_id: dict = {}
    for x in lines:
        per_id[x["id"]] = per_id.get(x["id"], 0) + 1
    done = [r for r in answered if r.get("tokens") is not None]
    lat = [r["latency_s"] for r in done]
    report = {
        "clients": a.clients, "duration_s": round(wall, 1), "max_batch": a.max_batch, "tree": a.tree,
        "publish": a.publish, "threads": a.threads, "cpu": cpu_name(),
        "requests": len(results), "answered": len(answered),
        "failures": [r for r in results if r.get("status") != 200 or "error" in r][:10],
        "failed": sum(1 for r in results if r.get("status") != 200 or "error" in r),
        "disconnects": sum(1 for r in results if r.get("disconnected")),
        "streaming": sum(1 for r in results if r["stream"]), "greedy": len(greedy),
        "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
        "completion_tokens": sum(r["tokens"] for r in done), "tokens_per_s": sum(r["tokens"] for r in done) / wall,
        "greedy_vs_alone": {"distinct_requests_checked": len(checked), "answers_compared": len(compared),
                            "mismatched": len(mismatched)},
        "log": {"lines": len(lines), "answered_during_load": len(answered), "alone_requests": len(alone),
                "answers_logged_exactly_once": sum(per_id.get(r["id"]) == 1 for r in answered),
                "answers_not_logged": sum(r["id"] not in per_id for r in answered),
                "duplicate_ids": sum(c > 1 for c in per_id.values()),
                # a disconnected stream whose row had already finished is logged too (its answer was complete)
                "lines_of_disconnected_requests": len(lines) - len(alone) - len(answered),
                "aborted_by_server": health.get("aborted")},
        "rss_mb": {"peak": max(v for _, v in rss) / 1024 if rss else None,
                   "first_minute_mean": _mean([v for t, v in rss if t < 60]) / 1024 if rss else None,
                   "last_minute_mean": _mean([v for t, v in rss if t > rss[-1][0] - 60]) / 1024 if rss else None,
                   "samples": [(round(t), v // 1024) for t, v in rss]},
    }
    write_json(out / "load.json", report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("failures",)}, default=str)[:3000], flush=True)
    return report


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
