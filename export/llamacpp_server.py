"""``llama-server`` for measurement: greedy completions of token-id prompts with llama.cpp's own timings and draft
counters (`LlamaServer`, `run_prompts`), and llama.cpp's plain decoding as methods of an interleaved decoding
benchmark (`llamacpp_plain_methods`). The build and the GGUF files come from ``export/llamacpp.py``."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from draftsmith.export.llamacpp import LlamaCpp, LlamaCppError, find_llamacpp, have_llamacpp, target_gguf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``llama-server`` on a GGUF target (with a drafter, or n-gram drafting, or none), one slot, for
    measurement: greedy completions of token-id prompts, with llama.cpp's own timings and draft counters."""

    def __init__(self, model: str | Path, *, threads: int = 2, ctx: int = 2048, draft: str | Path | None = None,
                 spec_type: str | None = None, draft_max: int = 3, parallel: int = 1, extra: list | None = None,
                 ll: LlamaCpp | None = None, log: Path | None = None):
        self.ll = ll or find_llamacpp()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [self.ll.bin("llama-server"), "-m", model, "-t", threads, "-tb", threads, "-c", ctx * parallel,
               "-np", parallel, "--host", "127.0.0.1", "--port", self.port, "--metrics", "--no-webui"]
        if draft is not None:
            cmd += ["-md", draft, "-td", threads, "-tbd", threads]
        if spec_type:
            cmd += ["--spec-type", spec_type, "--spec-draft-n-max", draft_max, "--spec-draft-n-min", 0,
                    "--spec-draft-p-min", 0]
        cmd += list(extra or [])
        self.cmd = [str(c) for c in cmd]
        self.log = log or Path(tempfile.mkstemp(suffix=".llama-server.log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._logf, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise LlamaCppError(f"llama-server exited ({self.proc.returncode}) while loading; "
                                    f"{self.log} ends with:\n{self.log.read_text()[-2500:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        self.__exit__(None, None, None)
        raise LlamaCppError(f"llama-server did not come up in 300 s; log {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "_logf", None):
            self._logf.close()

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, ids: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """One completion of a token-id prompt (greedy at temperature 0): tokens, wall seconds, llama.cpp's
        timings."""
        body = {"prompt": ids, "n_predict": n_predict, "temperature": temperature, "return_tokens": True,
                "cache_prompt": False, "seed": seed}
        if temperature == 0:
            body["top_k"] = 1
        t0 = time.perf_counter()
        r = self.post("/completion", body)
        wall = time.perf_counter() - t0
        return {"tokens": list(r.get("tokens") or []), "wall_s": wall, "timings": r.get("timings", {}),
                "stop_type": r.get("stop_type")}

    def metrics(self) -> dict:
        """The Prometheus counters (draft tokens, accepted, per position)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict = {"accepted_per_position": {}}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r'llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}\s+(\S+)', line)
            if m:
                out["accepted_per_position"][int(m.group(1))] = float(m.group(2))
                continue
            name, _, val = line.rpartition(" ")
            try:
                out[name.removeprefix("llamacpp:")] = float(val)
            except ValueError:
                pass
        return out


def run_prompts(server: LlamaServer, prompts: list[list[int]], n_predict: int, warmup: bool = True,
                temperature: float = 0.0) -> dict:
    """Every prompt once, in order (request i seeded i); tokens, wall time, llama.cpp's draft counters summed."""
    if warmup:
        server.complete(prompts[0], 8)
    before = server.metrics()
    toks, wall, drafted, accepted, pred_ms = [], 0.0, 0, 0, 0.0
    for i, p in enumerate(prompts):
        r = server.complete(p, n_predict, temperature, seed=i)
        toks.append(r["tokens"])
        wall += r["wall_s"]
        drafted += int(r["timings"].get("draft_n", 0) or 0)
        accepted += int(r["timings"].get("draft_n_accepted", 0) or 0)
        pred_ms += float(r["timings"].get("predicted_ms", 0) or 0)
    after = server.metrics()
    per_pos = {k: v - before["accepted_per_position"].get(k, 0) for k, v in after["accepted_per_position"].items()}
    steps = after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0)
    generated = sum(map(len, toks))
    return {"tokens": toks, "generated": generated, "wall_s": wall, "tok_s": generated / wall if wall else 0.0,
            "decode_tok_s": generated / (pred_ms / 1e3) if pred_ms else None, "decode_ms": pred_ms,
            "drafted": drafted, "accepted": accepted, "drafts": int(steps),
            "accepted_per_position": [per_pos[k] for k in sorted(per_pos)]}


def shipped_type(target) -> str:
    """The weights' type of the GGUF file ``target`` ships as ("?" when it ships none)."""
    from draftsmith.targets import shipped_gguf  # noqa: PLC0415 (only when asked)
    got = shipped_gguf(target.name, target.path)
    return got[1] if got else "?"


def llamacpp_plain_methods(servers: contextlib.ExitStack, figures: dict, target, types: list[str],
                           threads: int | None = None, sampling=None, logs: Path | None = None) -> list:
    """llama.cpp's plain decoding as methods of an interleaved benchmark (`draftsmith.eval.bench.run_bench`): one
    ``llama-server`` per GGUF type of the target (``shipped``: the file the default or a named target ships as, q4_1
    for the default), started in ``servers`` (the caller closes it after the run), each call one greedy request of
    a token-id prompt, timed from the request to the reply. An idle server takes about 1% of a core, so the
    methods run side by side with ours, prompt by prompt, and every speedup names them. With no llama.cpp build
    (or a sampled run, or a target llama.cpp cannot convert), none: ``figures["llamacpp"]`` says why; a type that
    fails to start costs its own method only (named there too). ``figures["llamacpp_files"]``: each method's GGUF
    file; ``logs``: each server's log as ``logs`` with the suffix ``.llamacpp-TYPE.log`` (default: a temporary
    file)."""
    from draftsmith.engine.metrics import DecodeResult  # noqa: PLC0415 (export -> engine: torch only where it runs)
    from draftsmith.eval.bench import Method  # noqa: PLC0415
    if not types:
        return []
    why = have_llamacpp()
    if why is None and sampling is not None and not sampling.greedy:
        why = "llama.cpp plain decoding is measured greedy only"
    if why is None and not (Path(str(target.path)) / "config.json").exists():
        why = f"the target {target.name} is not a model directory llama.cpp's converter can read"
    if why:
        figures["llamacpp"] = why
        return []
    if threads is None:
        import torch  # noqa: PLC0415
        threads = torch.get_num_threads()
    methods, failed = [], []
    for t in types:
        try:  # a target llama.cpp cannot convert or run costs its column, not the benchmark
            gguf = target_gguf(target, t)
            server = servers.enter_context(LlamaServer(
                gguf, threads=threads, log=None if logs is None else Path(logs).with_suffix(f".llamacpp-{t}.log")))
        except LlamaCppError as e:
            failed.append(f"{t}: {str(e).splitlines()[0]}")
            continue
        name = f"llama.cpp plain ({t})" if t != "shipped" else f"llama.cpp plain (shipped {shipped_type(target)})"
        figures.setdefault("llamacpp_files", {})[name] = str(gguf)

        def run(ids: list[int], n: int, seed: int, server=server) -> DecodeResult:
            r = server.complete(list(ids), n, seed=seed)
            return DecodeResult(tokens=r["tokens"], prompt_len=len(ids), wall_s=r["wall_s"],
                                counted_forwards=len(r["tokens"]),
                                stop_reason="eos" if r.get("stop_type") == "eos" else "max_new_tokens")
        methods.append(Method(name, run, "llama.cpp"))
    if failed:
        figures["llamacpp"] = "; ".join(failed)
    return methods


__all__ = ["LlamaServer", "free_port", "llamacpp_plain_methods", "run_prompts"]
