"""The server under load: a burst of long requests, then 1, 8 and 32 clients, then overload.

Each server named by ``--servers`` runs as its own process on loopback, one after the other, on the same CPU
threads, and meets the same client program (the OpenAI SDK, greedy, MT-Bench first turns, no retries):

  1. ``burst``: ``--burst`` requests of ``--burst-tokens`` sent at once, client timeout ``--burst-timeout``;
  2. ``clients-N`` for each N in ``--clients``: N clients in a closed loop for ``--phase-s`` seconds, requests
     of ``--tokens``, client timeout ``--timeout`` (a request in flight at the end finishes and counts);
  3. ``overload`` (``--overload K``): K requests at once against a queue of ``--max-queue``; past the bound a
     server should refuse (429 with Retry-After) rather than time out.

The phases run back to back, as a user's traffic would: a server that keeps decoding requests whose clients
timed out pays for them in the next phase. Per phase: answered, failed (timeout, 429, other), completion tok/s
over the phase's wall time, p50/p99 latency of answers, Retry-After values, the server's RSS (peak and last,
its whole process tree), and greedy consistency (answers to the same prompt and max_tokens that differ).

``--data-engine`` also runs the data engine (`draftsmith.train.data.batchgen.BatchGenerator`, the fused compiled step)
in this process on the same prompts, ``--max-batch`` rows, ``--tokens`` each, greedy: the tok/s the server's
32-client phase is measured against. With ``--data-engine``, ``--decoder`` runs the server's own batched decoder
(`draftsmith.engine.batched`, plain, continuous batching from a queue of the same prompts, no HTTP) in the same
process, alternating with the data engine for ``--rounds`` rounds: which part of the server's gap to the data
engine is the decoder's, and which the serving's.

Servers:
  * ``ours``: ``draftsmith serve`` from this tree (``--publish`` / ``--suffix`` / ``--tree`` / ``--max-batch``);
  * ``ours@REV``: the same command from git revision REV (a temporary worktree; before/after in one run);
  * ``vllm``: vLLM's OpenAI server (``.venv-vllm``, scripts/vllm_env.sh) on the target's directory, float32.

    OMP_NUM_THREADS=2 python -m benchmarks.serve_burst --servers ours ours@977f1a1 vllm --out runs/serve45
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

import torch

from benchmarks.common import add_common_args, free_port, parser, write_json
from benchmarks.serve_load import percentile
from draftsmith.chat import shared_prompt_prefix
from draftsmith.engine.batched import NewRow, plain_batched_decoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.sampling import TorchRandom
from draftsmith.eval.mtbench import mtbench_questions_path
from draftsmith.target import cpu_name, load_target, resolve_target_path
from draftsmith.traffic import chat_prompt_ids
from draftsmith.train.data.batchgen import BatchGenerator, Job

ROOT = Path(__file__).resolve().parent.parent


def questions(n: int) -> list[str]:
    rows = [json.loads(x) for x in mtbench_questions_path().read_text().splitlines() if x.strip()]
    return [r["turns"][0] for r in rows[:n]]


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and its descendants (MB), from /proc."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(k) for k in kids]
        except (OSError, ValueError):
            continue
    return total / 1024


def shim(rev: str, work: Path) -> tuple[Path, dict]:
    """A worktree of ``rev`` and a path folder mapping ``draftsmith`` onto it (as setup.py's FOLDERS does)."""
    tree = work / f"tree-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    pkg = work / f"pkg-{rev}" / "draftsmith"
    pkg.mkdir(parents=True)
    ns: dict = {}
    setup_src = (tree / "setup.py").read_text()
    start = setup_src.index("FOLDERS")
    exec(setup_src[start:setup_src.index("}", start) + 1], ns)  # the FOLDERS literal only
    for sub, folder in ns["FOLDERS"].items():
        if sub == "draftsmith":
            for f in (tree / folder).glob("*.py"):
                (pkg / f.name).symlink_to(f)
        else:
            (pkg / sub.split(".", 1)[1]).symlink_to(tree / folder)
    return tree, {"PYTHONPATH": str(pkg.parent)}


class Server:
    """One server process on loopback; ``stop`` ends it (and its children)."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path, ready_path: str, cwd: Path):
        self.name, self.port = name, port
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        self.ready_path = ready_path

    def wait_ready(self, timeout: float) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.base + self.ready_path, timeout=2).status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


def one(client_factory, model: str, prompt: str, n: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = client_factory(timeout).chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0)
    except openai.RateLimitError as e:
        return {"ok": False, "why": "429", "retry_after": e.response.headers.get("retry-after"),
                "s": time.perf_counter() - t0}
    except openai.APITimeoutError:
        return {"ok": False, "why": "timeout", "s": time.perf_counter() - t0}
    except openai.APIStatusError as e:
        return {"ok": False, "why": f"http {e.status_code}", "s": time.perf_counter() - t0}
    except openai.APIConnectionError as e:
        return {"ok": False, "why": f"connection: {e}", "s": time.perf_counter() - t0}
    return {"ok": True, "s": time.perf_counter() - t0, "tokens": r.usage.completion_tokens,
            "text": r.choices[0].message.content}


def phase(name: str, srv: Server, make, model: str, jobs: list[tuple[int, str, int]] | None, clients: int,
          phase_s: float, prompts: list[str], n: int, timeout: float) -> dict:
    """``jobs``: requests sent at once; else ``clients`` closed-loop clients for ``phase_s``."""
    results: list[dict] = []
    lock = threading.Lock()
    rss: list[float] = []
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            rss.append(tree_rss_mb(srv.proc.pid))
            stop.wait(1.0)

    def send(i: int, prompt: str, m: int):
        r = one(make, model, prompt, m, timeout)
        r.update(prompt=i, max_tokens=m)
        with lock:
            results.append(r)

    threading.Thread(target=sampler, daemon=True).start()
    t0 = time.perf_counter()
    if jobs is not None:
        ths = [threading.Thread(target=send, args=j) for j in jobs]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    else:
        end = t0 + phase_s

        def loop(k: int):
            j = k
            while time.perf_counter() < end:
                send(j % len(prompts), prompts[j % len(prompts)], n)
                j += clients
        ths = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    wall = time.perf_counter() - t0
    stop.set()
    ok = [r for r in results if r["ok"]]
    fails: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            fails[r["why"]] = fails.get(r["why"], 0) + 1
    lat = [r["s"] for r in ok]
    out = {"phase": name, "requests": len(results), "answered": len(ok), "failed": fails, "wall_s": round(wall, 1),
           "tok_s": round(sum(r["tokens"] for r in ok) / wall, 2) if wall else None,
           "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99),
           "retry_after": sorted({r["retry_after"] for r in results if r.get("retry_after")}),
           "rss_mb_peak": round(max(rss), 1) if rss else None, "rss_mb_last": round(rss[-1], 1) if rss else None}
    print(f"  {srv.name:>14} {name:>10}: {out['answered']}/{out['requests']} answered, failed {fails}, "
          f"{out['tok_s']} tok/s, p50 {out['p50_s'] and round(out['p50_s'], 1)} s, "
          f"p99 {out['p99_s'] and round(out['p99_s'], 1)} s, RSS peak {out['rss_mb_peak']} MB", flush=True)
    return out, ok


def data_engine(a, prompts: list[str]) -> dict:
    """The data engine on the same prompts (chat template), ``max_batch`` rows, greedy: generated tok/s over
    the wall time (prefills included), after a warm-up that compiles each of its step's graphs
    (`FastBatchBody.graph_rows`: up to 16 rows, and past 16)."""
    torch.set_num_threads(a.threads)
    target = load_target(a.target)
    ids = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    gen = BatchGenerator(target.model, target.eos_token_ids, max_rows=a.max_batch, capacity=2048,
                         forward="compile")
    for n in gen.fast.graph_rows(a.max_batch) if gen.fast is not None else [2]:  # compiles each of its graphs
        gen.run([Job(i, ids[i % len(ids)], 4) for i in range(n)], lambda j, t, f: None)
    dec = None
    if a.decoder:
        use_fast_forward(target, "compile")
        dec = plain_batched_decoder(target)  # one decoder for every round, as the server holds one
        dec.set_prefix(shared_prompt_prefix(target.tokenizer))  # the chat template's shared prefix, as serve sets it
        dec.warmup(ids[0], 4, a.max_batch, 2048)  # compiles its graphs and sets up its cache, as serve does
    rounds = []
    for _ in range(a.rounds if a.decoder else 1):
        done: list[int] = []
        t0 = time.perf_counter()
        gen.run([Job(i, p, a.tokens) for i, p in enumerate(ids)], lambda j, t, f: done.append(len(t)))
        wall = time.perf_counter() - t0
        rnd = {"data_engine": rate(a, ids, sum(done), wall)}
        print(f"  data engine ({a.max_batch} rows): {sum(done)} tokens in {wall:.1f} s = "
              f"{rnd['data_engine']['tok_s']} tok/s", flush=True)
        if a.decoder:
            rnd["decoder"] = d = batched_decoder(a, dec, ids)
            print(f"  batched decoder ({a.max_batch} rows): {d['tokens']} tokens in {d['wall_s']} s = {d['tok_s']} "
                  f"tok/s ({d['tok_s'] / rnd['data_engine']['tok_s']:.2f}x the data engine)", flush=True)
        rounds.append(rnd)
    return {**rounds[0]["data_engine"], "rounds": rounds} if a.decoder else rounds[0]["data_engine"]


def batched_decoder(a, dec, ids: list[list[int]]) -> dict:
    """The server's batched decoder (plain, ``--max-batch`` rows; ``dec``, warmed up as the server warms its own)
    on the same prompts, without HTTP: the first rows start together and the rest join from a queue as rows free
    up, each as it comes (the server's default), greedy, ``--tokens`` each; generated tok/s over the wall time
    (prefills included)."""
    rows = min(a.max_batch, len(ids))
    queue = list(range(rows, len(ids)))
    made = [0]

    def admit(free: int) -> list[NewRow]:
        take = [queue.pop(0) for _ in range(min(free, len(queue)))]
        return [NewRow(ids[i], a.tokens, TorchRandom(0), None) for i in take]

    def on_step(row: int, new_ids: list[int], st, stop) -> bool:
        made[0] += len(new_ids)
        return False

    t0 = time.perf_counter()
    dec.generate([ids[i] for i in range(rows)], [a.tokens] * rows, rngs=[TorchRandom(0) for _ in range(rows)],
                 on_step=on_step, admit=admit, max_rows=a.max_batch, capacity=2048, release=True)
    wall = time.perf_counter() - t0
    return rate(a, ids, made[0], wall)


def rate(a, ids: list[list[int]], tokens: int, wall: float) -> dict:
    """One in-process generation's figures: rows, prompts, tokens, wall seconds, tok/s."""
    return {"rows": a.max_batch, "prompts": len(ids), "tokens": tokens, "wall_s": round(wall, 1),
            "tok_s": round(tokens / wall, 2)}


def batching(srv, spec: str) -> dict | None:
    """Our server's batching counters from ``/health`` (None for vLLM, or a server without them)."""
    if spec == "vllm":
        return None
    try:
        return httpx.get(srv.base + "/health", timeout=10).json().get("batching")
    except (httpx.HTTPError, ValueError):
        return None


def main(argv: list[str] | None = None) -> dict:
    ap = parser("serve_burst", __doc__)
    add_common_args(ap, threads=True, threads_default=2)
    ap.add_argument("--servers", nargs="*", default=["ours"], help="ours, ours@REV, vllm (none: --data-engine only)")
    ap.add_argument("--publish", default=None, help="ours: publish directory (a drafter)")
    ap.add_argument("--suffix", action="store_true", help="ours: SuffixDecoding")
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--admit-group", type=int, default=None, help="ours (not ours@REV): serve's --admit-group")
    ap.add_argument("--draft-max-rows", type=int, default=None, help="ours (not ours@REV): serve's --draft-max-rows")
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--burst-tokens", type=int, default=256)
    ap.add_argument("--burst-timeout", type=float, default=300)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--phase-s", type=float, default=60)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--overload", type=int, default=0, help="requests sent at once past the queue (0: no phase)")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--data-engine", action="store_true", help="also the data engine in-process (see above)")
    ap.add_argument("--decoder", action="store_true", help="with --data-engine: also the server's batched decoder "
                                                           "in-process, alternating with it (see above)")
    ap.add_argument("--rounds", type=int, default=2, help="--decoder: rounds of the data engine and the decoder")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = questions(a.prompts)
    _, target_dir = resolve_target_path(a.target)
    work = Path(tempfile.mkdtemp(prefix="serve_burst_"))
    env0 = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    report = {"cpu": cpu_name(), "threads": a.threads, "target": a.target, "args": vars(a), "servers": {}}
    model = "smollm2"
    for spec in a.servers:
        port = free_port()
        if spec == "vllm":
            vpy = ROOT / ".venv-vllm" / "bin" / "python"
            if not vpy.exists():
                print("vllm: no .venv-vllm (bash scripts/vllm_env.sh): left out", flush=True)
                report["servers"][spec] = "not built"
                continue
            env = dict(env0, VLLM_CPU_OMP_THREADS_BIND="nobind",
                       VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
            cmd = [str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir),
                   "--served-model-name", model, "--port", str(port), "--dtype", "float32",
                   "--max-model-len", "2048", "--max-num-seqs", str(a.max_batch), "--no-enable-log-requests"]
            cwd = work
        else:
            env, cwd = dict(env0), ROOT
            if "@" in spec:
                tree, extra = shim(spec.split("@", 1)[1], work)
                env.update(extra)
                cwd = tree
            logs = (out / f"{spec.replace('@', '_')}-logs").resolve()  # absolute: ours@REV runs in its worktree
            shutil.rmtree(logs, ignore_errors=True)
            cmd = [sys.executable, "-m", "draftsmith.cli", "serve", "--target", a.target, "--port", str(port),
                   "--model-name", model, "--max-batch", str(a.max_batch), "--threads", str(a.threads),
                   "--tree", a.tree, "--logs", str(logs)]
            cmd += ["--publish", str(Path(a.publish).resolve())] if a.publish else []
            cmd += ["--suffix"] if a.suffix else []
            if "@" not in spec:
                cmd += ["--max-queue", str(a.max_queue)]
                cmd += ["--admit-group", str(a.admit_group)] if a.admit_group else []
                cmd += ["--draft-max-rows", str(a.draft_max_rows)] if a.draft_max_rows else []
        print(f"{spec}: {' '.join(cmd)}", flush=True)
        srv = Server(spec, cmd, env, port, out / f"{spec.replace('@', '_')}.log", "/v1/models", cwd)
        rec: dict = {"command": cmd}
        try:
            rec["ready_s"] = round(srv.wait_ready(a.ready_timeout), 1)

            def make(timeout, base=srv.base):
                return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=timeout, max_retries=0)
            one(make, model, prompts[0], 8, 600)  # warm-up (compilation), not counted
            phases, answers = [], []
            jobs = [(i % len(prompts), prompts[i % len(prompts)], a.burst_tokens) for i in range(a.burst)]
            p, ok = phase("burst", srv, make, model, jobs, 0, 0, prompts, a.burst_tokens, a.burst_timeout)
            phases.append(p)
            answers += ok
            p["batching"] = batching(srv, spec)
            for c in a.clients:
                p, ok = phase(f"clients-{c}", srv, make, model, None, c, a.phase_s, prompts, a.tokens, a.timeout)
                p["batching"] = batching(srv, spec)  # ours: cumulative counts after the phase
                phases.append(p)
                answers += ok
            if a.overload:
                jobs = [(i % len(prompts), prompts[i % len(prompts)], a.tokens) for i in range(a.overload)]
                p, ok = phase("overload", srv, make, model, jobs, 0, 0, prompts, a.tokens, a.timeout)
                phases.append(p)
                answers += ok
            texts: dict = {}
            for r in answers:
                texts.setdefault((r["prompt"], r["max_tokens"]), set()).add(r["text"])
            rec.update(phases=phases, greedy_keys=len(texts),
                       greedy_inconsistent=sum(len(v) > 1 for v in texts.values()))
            if spec != "vllm":  # every answer logged once; a request whose client left is not (ours) or is
                time.sleep(2)
                ids = [json.loads(x)["id"] for f in sorted(logs.glob("*.jsonl")) for x in f.read_text().splitlines()
                       if x.strip()]
                rec["log"] = {"lines": len(ids), "distinct": len(set(ids)),
                              "answered": len(answers) + 1}  # + the warm-up request
        except Exception as e:  # noqa: BLE001 (one server failing is a result; the others still run)
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"{spec}: FAILED {rec['error']}", flush=True)
        finally:
            srv.stop()
        report["servers"][spec] = rec
        write_json(out / "serve_burst.json", report)
    if a.data_engine:
        report["data_engine"] = data_engine(a, prompts)
        write_json(out / "serve_burst.json", report)
    for spec in a.servers:
        if "@" in spec:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(work / f"tree-{spec.split('@', 1)[1]}")], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
