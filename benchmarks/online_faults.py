"""Fault figures of the online loop (the suite runs short versions of each; these are the full runs).

    python -m benchmarks.online_faults kills  --out DIR [--records 1000] [--kills 20] [--target tiny|NAME]
    python -m benchmarks.online_faults load   --out DIR [--clients 8] [--seconds 120] [--target tiny|NAME]
    python -m benchmarks.online_faults reader --out DIR [--seconds 60] [--target tiny|NAME]

kills: a replay of --records logged records (synthetic served records with acceptance data, or --logs
DIR) is applied by `draftsmith online RECIPE --logs DIR --once` in a subprocess that is kill -9'd at
--kills random moments and restarted until it finishes; then the ledger must show every record
applied exactly once (distinct ids, counts, the committed model's own count).
load: the server (uvicorn on loopback) under --clients concurrent clients for --seconds while a
publisher switches versions every --publish-every seconds: failed requests, logged lines, and greedy
responses equal to plain decoding.
reader: a loop that loads the current drafter (as the server does) during publications: partial loads.
``--target tiny`` (default) builds a tiny random Llama saved to DIR/target (`benchmarks.common.tiny_target`),
so the figures measure the machinery and not the model; any target name or directory works the same way.
Writes DIR/<mode>.json.
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

import yaml

from benchmarks.common import add_common_args, parser, serve_in_thread, setup, write_json
from draftsmith.checkpoint import drafter_from_checkpoint, read_manifest, save_checkpoint
from draftsmith.engine.decoder import plain_decoder
from draftsmith.publish import PublishStore, load_current
from draftsmith.recipe import parse_recipe
from draftsmith.traffic import TrafficLog, chat_prompt_ids, make_record
from draftsmith.train.online.ledger import Ledger
from draftsmith.train.training.trainer import build_drafter


def _recipe_raw(target, out: Path, **online) -> dict:
    return {"name": "faults", "target": str(target.path), "output_dir": str(out / "run"), "seed": 0,
            "drafter": {"kind": "medusa", "num_heads": 2, "num_layers": 1}, "cache": {"dtype": "float32"},
            "train": {"chunk_len": 16, "tracker": "none"},
            "online": {"every_records": 50, "holdout_every": 10, "holdout_window": 4, "eval_max_new_tokens": 8,
                       "batch_size": 8, "max_steps": 2, "poll_seconds": 0.05, **online}}


def _checkpoints(target, out: Path, n: int) -> list[Path]:
    import torch
    r = parse_recipe(_recipe_raw(target, out))
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        m = build_drafter(r, target)
        for p in m.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.5)
        paths.append(save_checkpoint(out / "ckpts" / f"c{i}", m, target, recipe=r.model_dump(mode="json")))
    return paths


def _applied(out: Path) -> int:
    if not (out / "state" / "ledger.sqlite").exists():
        return -1
    led = Ledger(out / "state")
    try:
        return led.counts()["applied"]
    finally:
        led.close()


def kills(a, out: Path, target) -> dict:
    logs = Path(a.logs) if a.logs else out / "logs"
    if not a.logs and not logs.exists():
        log = TrafficLog(logs, max_bytes=256 << 10)  # small files: the replay crosses many rotations
        rnd = random.Random(0)
        V = target.vocab_size
        for i in range(a.records):
            prompt = [rnd.randrange(3, V) for _ in range(rnd.randint(4, 12))]
            resp = [rnd.randrange(3, V) for _ in range(rnd.randint(6, 24))]
            steps, left = [], len(resp)
            while left:
                e = min(left, rnd.randint(1, 3))
                steps.append([e - 1, min(e, 2), 2, e])
                left -= e
            log.write(make_record(request={"i": i}, prompt_ids=prompt, response_ids=resp, response_text="",
                                  finish_reason="length", target_name=target.name, fingerprint=target.fingerprint,
                                  drafter_version=None, drafter_kind=None, steps=steps, request_id=f"r{i}",
                                  started=0.0, finished=0.0))
        log.close()
    lines = sum(len(f.read_bytes().splitlines()) for f in logs.glob("*.jsonl"))
    rfile = out / "recipe.yaml"
    # small updates (each with its gate), so a replay spans many commits and the kills land between them
    rfile.write_text(yaml.safe_dump(_recipe_raw(target, out, every_records=a.every_records)))
    cmd = [sys.executable, "-m", "draftsmith.cli", "online", str(rfile), "--logs", str(logs), "--once",
           "--state", str(out / "state"), "--publish", str(out / "publish")]
    rnd = random.Random(a.seed)
    n_kills, runs, t0, at_kill = 0, 0, time.time(), []
    while True:
        runs += 1
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if n_kills < a.kills:
            # wait until this run has committed something (so kills spread over the replay instead of all
            # landing in the start-up of the same update), then kill at a random moment after that
            base, t_start = _applied(out), time.time()
            while p.poll() is None and _applied(out) == base and time.time() - t_start < 600:
                time.sleep(0.1)
            time.sleep(rnd.uniform(a.min_delay, a.max_delay))
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                n_kills += 1
                led = Ledger(out / "state")  # what the killed run had committed: progress between kills
                at_kill.append(led.counts()["applied"])
                led.close()
                print(f"kill {n_kills} at run {runs}: {at_kill[-1]} records applied so far", flush=True)
                continue
        outp = p.communicate()[0]
        if p.returncode != 0:
            raise RuntimeError(f"online job failed:\n{outp[-4000:]}")
        break  # a run that ends on its own has applied the whole replay (--once)
    led = Ledger(out / "state")
    c = led.counts()
    srcs = [r[0] for r in led.db.execute("SELECT src FROM records")] + \
        [r[0] for r in led.db.execute("SELECT src FROM quarantine")]
    model = out / "state" / "models" / c["model"]
    res = {"log_lines": lines, "kills": n_kills, "runs": runs, "counts": c, "applied_at_each_kill": at_kill,
           "distinct_ids": len(set(srcs)), "ids": len(srcs),
           "model_records_applied": read_manifest(model)["metrics"]["records_applied"],
           "updates": len(led.updates()), "sum_update_new": sum(u["n_new"] for u in led.updates()),
           "wall_s": round(time.time() - t0, 1)}
    res["exactly_once"] = (res["distinct_ids"] == res["ids"] == lines and
                           res["model_records_applied"] == c["applied"] == res["sum_update_new"])
    return res


def load(a, out: Path, target) -> dict:
    import httpx
    from draftsmith.serve.app import DecodingService
    cks = _checkpoints(target, out, 3)
    store = PublishStore(out / "publish")
    store.publish(cks[0])
    svc = DecodingService(target, publish_dir=out / "publish", log_dir=out / "logs", model_name="t")
    server, port = serve_in_thread(svc)
    prompts = [[{"role": "user", "content": f"question number {i}: why?"}] for i in range(8)]
    plain = plain_decoder(target)
    expect = [target.tokenizer.decode(plain.generate(chat_prompt_ids(target.tokenizer, m), a.max_tokens).tokens,
                                      skip_special_tokens=True) for m in prompts]
    stats = {"ok": 0, "failed": 0, "mismatch": 0, "errors": []}
    lock, stop = threading.Lock(), time.time() + a.seconds

    def client(k: int) -> None:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600)
        j = 0
        while time.time() < stop:
            i = (k + j) % len(prompts)
            j += 1
            try:
                body = {"model": "t", "messages": prompts[i], "max_tokens": a.max_tokens, "temperature": 0}
                if j % 2:
                    r = c.post("/chat/completions", json=body)
                    r.raise_for_status()
                    text = r.json()["choices"][0]["message"]["content"]
                else:
                    text = ""
                    with c.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                with lock:
                    stats["ok"] += 1
                    stats["mismatch"] += text != expect[i]
            except Exception as e:  # noqa: BLE001 (counted: the figure is the number of failures)
                with lock:
                    stats["failed"] += 1
                    stats["errors"].append(repr(e)[:300])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    for t in threads:
        t.start()
    published = 0
    while time.time() < stop:
        time.sleep(a.publish_every)
        store.publish(cks[published % 3], keep=3)
        published += 1
    for t in threads:
        t.join()
    server.should_exit = True
    svc.log.close()
    logged = sum(len(f.read_bytes().splitlines()) for f in (out / "logs").glob("*.jsonl"))
    return {**stats, "errors": stats["errors"][:10], "published": published, "swaps": svc.swaps,
            "logged": logged, "every_request_logged": logged == stats["ok"], "clients": a.clients,
            "seconds": a.seconds}


def reader(a, out: Path, target) -> dict:
    cks = _checkpoints(target, out, 3)
    store = PublishStore(out / "publish")
    store.publish(cks[0])
    stop = time.time() + a.seconds
    res = {"loads": 0, "failed": 0, "errors": [], "published": 0}

    def pub() -> None:
        while time.time() < stop:
            store.publish(cks[res["published"] % 3], keep=2)
            res["published"] += 1

    th = threading.Thread(target=pub)
    th.start()
    while time.time() < stop:
        try:
            v, d = load_current(store, lambda p: drafter_from_checkpoint(p, target))
            res["loads"] += v is not None
        except Exception as e:  # noqa: BLE001 (counted)
            res["failed"] += 1
            res["errors"].append(repr(e)[:300])
    th.join()
    res["errors"] = res["errors"][:10]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = parser("online_faults", __doc__)
    ap.add_argument("mode", choices=("kills", "load", "reader"))
    add_common_args(ap, target_default="tiny", seed=True, out="dir", target_help="tiny (a tiny random Llama saved "
                    "to OUT/target), a target name or a local Hugging Face directory (default: tiny)")
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--logs", default=None, help="kills: replay these logs instead of synthetic records")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--every-records", type=int, default=10, help="kills: records per update of the job")
    ap.add_argument("--min-delay", type=float, default=0.0,
                    help="kills: seconds after the run commits before a kill ...")
    ap.add_argument("--max-delay", type=float, default=2.0, help="... at most")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--publish-every", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    bench = setup(a, tiny=True)
    res = {"kills": kills, "load": load, "reader": reader}[a.mode](a, bench.out, bench.target)
    write_json(bench.out / f"{a.mode}.json", res)
    print(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
