"""The stages after training, on a finished run of any target: export, publish, serve (with traffic) and one online
update from the served logs. It is how the named targets are shown to go through every stage.

    python -m benchmarks.stages_check RUN_DIR [--requests 16] [--max-tokens 64] [--threads 2] [--port 8765]

RUN_DIR is a `draftsmith run` output (its ``final`` checkpoint and ``recipe.json``). In order, each a
`draftsmith` command in a subprocess, timed, its exit status and last lines kept:
  1. ``export final --to draftsmith`` (and ``--to vllm-medusa`` or ``--to vllm-eagle3`` where the kind has one);
  2. ``publish final --to OUT/publish`` (the greedy-equality check against the target);
  3. ``serve --publish OUT/publish --logs OUT/logs`` on loopback, with ``--requests`` chat requests from the run's
     own training prompts (never MT-Bench), one at a time, through the OpenAI-compatible route; the server is
     stopped after;
  4. ``online RECIPE --logs OUT/logs --once`` with the run's recipe: one update from those logs, gated and
     published (or refused by the gate) into OUT/publish.
Writes OUT/stages.json (OUT = RUN_DIR/stages, emptied first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

EXPORTS = {"medusa": ["draftsmith", "vllm-medusa"], "eagle3": ["draftsmith", "vllm-eagle3"]}


def _run(name: str, cmd: list[str], log: Path, report: dict) -> bool:
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-4:]
    report[name] = {"command": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                    "tail": tail}
    print(f"{name}: rc {rc} in {report[name]['seconds']} s; " + (tail[-1] if tail else ""), flush=True)
    return rc == 0


def _prompts(run: Path, n: int) -> list[str]:
    out = []
    for line in (run / "data" / "train.jsonl").read_text().splitlines():
        try:
            msgs = json.loads(line)["messages"]
        except (ValueError, KeyError, TypeError):
            continue
        user = next((m["content"] for m in msgs if m.get("role") == "user"), None)
        if user:
            out.append(user)
        if len(out) == n:
            break
    return out


def _post(port: int, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stages_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args(argv)
    run, ds = a.run.resolve(), [sys.executable, "-m", "draftsmith.cli"]
    recipe = json.loads((run / "recipe.json").read_text())
    out = run / "stages"
    shutil.rmtree(out, ignore_errors=True)  # a fresh check each time: exports refuse an existing folder
    out.mkdir()
    final = run / "final"
    report: dict = {"run": str(run), "target": recipe["target"], "kind": recipe["drafter"]["kind"]}
    for fmt in EXPORTS.get(recipe["drafter"]["kind"], ["draftsmith"]):
        _run(f"export {fmt}", [*ds, "export", str(final), "--to", fmt, "--out", str(out / f"export-{fmt}")],
             out / f"export-{fmt}.log", report)
    pub, logs = out / "publish", out / "logs"
    _run("publish", [*ds, "publish", str(final), "--to", str(pub)], out / "publish.log", report)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    serve_log = open(out / "serve.log", "w")
    server = subprocess.Popen([*ds, "serve", "--target", recipe["target"], "--publish", str(pub), "--logs",
                               str(logs), "--port", str(a.port), "--threads", str(a.threads)],
                              stdout=serve_log, stderr=subprocess.STDOUT, env=env)
    served: dict = {"requests": 0, "ok": 0, "tokens": 0, "errors": []}
    try:
        t0 = time.perf_counter()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.perf_counter() - t0 > 900:
                    raise RuntimeError(f"the server did not come up (rc {server.poll()}); see {out / 'serve.log'}")
                time.sleep(2)
        served["startup_s"] = round(time.perf_counter() - t0, 1)
        with urllib.request.urlopen(f"http://127.0.0.1:{a.port}/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        t0 = time.perf_counter()
        for p in _prompts(run, a.requests):
            served["requests"] += 1
            try:
                r = _post(a.port, {"model": model, "messages": [{"role": "user", "content": p}],
                                   "max_tokens": a.max_tokens, "temperature": 0})
                served["ok"] += 1
                served["tokens"] += int(r["usage"]["completion_tokens"])
            except Exception as e:  # noqa: BLE001 (counted and reported, the rest still sent)
                served["errors"].append(f"{type(e).__name__}: {e}")
        served["seconds"] = round(time.perf_counter() - t0, 1)
        served["tok_s"] = round(served["tokens"] / max(served["seconds"], 1e-9), 2)
    finally:
        server.terminate()
        server.wait(timeout=60)
        serve_log.close()
    report["serve"] = served
    print(f"serve: {served['ok']}/{served['requests']} answered, {served['tokens']} tokens, "
          f"{served.get('tok_s')} tok/s one at a time", flush=True)
    _run("online", [*ds, "online", str(run / "recipe.json"), "online.every_records=4", "online.holdout_every=4",
                    f"output_dir={out / 'online-out'}", "--logs", str(logs), "--once", "--publish", str(pub),
                    "--state", str(out / "online")], out / "online.log", report)
    (out / "stages.json").write_text(json.dumps(report, indent=1))
    ok = all(v.get("rc", 0) == 0 for v in report.values() if isinstance(v, dict)) and served["ok"] == served["requests"]
    print(f"every stage ran: {ok}; {out / 'stages.json'}")
    report["pass"] = ok
    return report


if __name__ == "__main__":
    main()
