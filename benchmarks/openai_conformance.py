"""The same OpenAI-API requests sent to our server and to vLLM's OpenAI server, on loopback: a conformance table.

For each feature, the same request (chat or text completion, streaming or not, good or malformed) goes to both
servers; the table shows the status code each answered, whether the greedy text is the same, which response
fields each returned, and what the OpenAI API defines. Both serve the same converted target in float32; ours
with the drafter current in ``--publish`` (if any) and ``--tree``, vLLM plain.

    OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.openai_conformance \\
        --publish runs/pub --tree built:4 --out runs/conformance

vLLM is started from ``--vllm-python`` (default .venv-vllm/bin/python) with libiomp5 preloaded, or reached at
``--vllm-url`` when one is already running. Writes OUT/conformance.json and OUT/conformance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.common import add_common_args, parser, serve_in_thread, setup, write_json
from draftsmith.export.vllm_check import vllm_python
from draftsmith.serve.app import DecodingService

M1 = [{"role": "user", "content": "Name three colors."}]
MULTI = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]}]

# (feature, route, body, what the OpenAI API defines). Greedy unless the body says otherwise.
GOOD = [
    ("chat: basic", "chat", {"messages": M1, "max_tokens": 32}, "200, message.content, usage"),
    ("chat: system + assistant turns", "chat", {"messages": MULTI, "max_tokens": 24}, "200"),
    ("chat: content as text parts", "chat", {"messages": PARTS, "max_tokens": 24}, "200 (text parts accepted)"),
    ("chat: max_completion_tokens", "chat", {"messages": M1, "max_completion_tokens": 7},
     "200, 7 tokens, finish_reason length"),
    ("chat: stop list", "chat", {"messages": M1, "max_tokens": 32, "stop": [",", "\n"]},
     "200, text cut before the stop, finish_reason stop"),
    ("chat: logprobs + top_logprobs=2", "chat", {"messages": M1, "max_tokens": 8, "logprobs": True,
                                                 "top_logprobs": 2}, "200, logprobs.content[*].top_logprobs"),
    ("chat: frequency_penalty=1.5", "chat", {"messages": M1, "max_tokens": 48, "frequency_penalty": 1.5},
     "200, penalised output"),
    ("chat: presence_penalty=1.5", "chat", {"messages": M1, "max_tokens": 48, "presence_penalty": 1.5},
     "200, penalised output"),
    ("chat: logit_bias", "chat", {"messages": M1, "max_tokens": 16, "logit_bias": {"1345": 8, "28": -100}},
     "200, biased output"),
    ("chat: repetition_penalty (vLLM ext.)", "chat", {"messages": M1, "max_tokens": 48, "repetition_penalty": 1.3},
     "not in the API (vLLM extension)"),
    ("chat: seed, T=0.8", "chat", {"messages": M1, "max_tokens": 16, "temperature": 0.8, "seed": 7},
     "200 (sampled: text not compared)"),
    ("chat: stream + include_usage", "chat", {"messages": M1, "max_tokens": 24, "stream": True,
                                              "stream_options": {"include_usage": True}},
     "200, chunks, a last chunk with usage and no choices"),
    ("completions: text prompt", "completion", {"prompt": "The capital of France is", "max_tokens": 16},
     "200, choices[0].text, usage"),
    ("completions: stream", "completion", {"prompt": "The capital of France is", "max_tokens": 16, "stream": True,
                                           "stream_options": {"include_usage": True}}, "200, chunks"),
    ("completions: echo + logprobs=2", "completion", {"prompt": "Once upon a time", "max_tokens": 8, "echo": True,
                                                      "logprobs": 2}, "200, prompt echoed, logprobs lists"),
    ("completions: token-id prompt", "completion", {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 8},
     "200"),
]
BAD = [  # (feature, route, body change, what the OpenAI API defines)
    ("role 'wizard'", "chat", {"messages": [{"role": "wizard", "content": "x"}]}, "400"),
    ("temperature 1e6", "chat", {"temperature": 1e6}, "400 (range [0, 2])"),
    ("temperature -1", "chat", {"temperature": -1}, "400 (range [0, 2])"),
    ("top_p 1.5", "chat", {"top_p": 1.5}, "400 (range [0, 1])"),
    ("max_tokens true", "chat", {"max_tokens": True}, "400 (integer)"),
    ("max_tokens 0", "chat", {"max_tokens": 0}, "400"),
    ("max_tokens 'ten'", "chat", {"max_tokens": "ten"}, "400 (integer)"),
    ("messages []", "chat", {"messages": []}, "400"),
    ("message without content", "chat", {"messages": [{"role": "user"}]}, "400"),
    ("image_url content part", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "200 for vision models; 400 otherwise"),
    ("n 2", "chat", {"n": 2}, "200 (2 choices); we serve n=1 only"),
    ("frequency_penalty 3", "chat", {"frequency_penalty": 3}, "400 (range [-2, 2])"),
    ("logit_bias value 200", "chat", {"logit_bias": {"5": 200}}, "400 (range [-100, 100])"),
    ("logit_bias key 'abc'", "chat", {"logit_bias": {"abc": 1}}, "400"),
    ("top_logprobs without logprobs", "chat", {"top_logprobs": 2}, "400"),
    ("top_logprobs 30", "chat", {"logprobs": True, "top_logprobs": 30}, "400 (range [0, 20])"),
    ("stop: 5 sequences", "chat", {"stop": ["a", "b", "c", "d", "e"]}, "400 (up to 4)"),
    ("stream_options without stream", "chat", {"stream_options": {"include_usage": True}}, "400"),
    ("tools given", "chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "200 (tool calling); we refuse: not implemented"),
    ("response_format json_object", "chat", {"response_format": {"type": "json_object"}},
     "200 (JSON mode); we refuse: not implemented"),
    ("unknown field", "chat", {"frobnicate": 1}, "400 (unrecognized argument)"),
    ("unknown model", "chat", {"model": "nope"}, "404"),
    ("prompt too long", "chat", {"max_tokens": 100000}, "400"),
    ("body not JSON", "chat", None, "400"),
    ("completions: suffix", "completion", {"suffix": "x"}, "200 for models with insertion; we refuse"),
    ("completions: best_of 2", "completion", {"best_of": 2}, "200 (2 candidates); we serve 1"),
    ("completions: logprobs 6", "completion", {"logprobs": 6}, "400 (max 5)"),
    ("completions: empty prompt", "completion", {"prompt": ""}, "400"),
]
IGNORE_FIELDS = {"id", "created", "system_fingerprint", "service_tier", "draftsmith", "prompt_logprobs",
                 "prompt_token_ids", "kv_transfer_params", "stop_reason", "token_ids", "reasoning_content",
                 "reasoning", "annotations", "audio", "function_call", "tool_calls", "refusal", "metadata",
                 "prompt_tokens_details", "completion_tokens_details", "routed_experts", "prompt_text",
                 "ec_transfer_params", "metrics"}


def _fields(obj, prefix: str = "") -> set[str]:
    """Dotted paths of the keys present (lists: their first element, as '*'); None values count as present."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in IGNORE_FIELDS:
                continue
            p = f"{prefix}.{k}" if prefix else k
            out.add(p)
            out |= _fields(v, p)
    elif isinstance(obj, list) and obj:
        out |= _fields(obj[0], f"{prefix}.*")
    return out


def _post(base: str, route: str, body) -> dict:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    if body is None:
        r = httpx.post(base + path, content=b"{nope", headers={"content-type": "application/json"}, timeout=600)
    else:
        r = httpx.post(base + path, json=body, timeout=600)
    out = {"status": r.status_code, "seconds": round(time.perf_counter() - t0, 2)}
    if body is not None and body.get("stream") and r.status_code == 200:
        chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: ") and x[6:] != "[DONE]"]
        key = "delta" if route == "chat" else None
        out["text"] = "".join((c["choices"][0][key].get("content") or "") if key else c["choices"][0]["text"]
                              for c in chunks if c.get("choices"))
        out["fields"] = sorted(set().union(*(_fields(c) for c in chunks)))
        out["usage_chunk"] = bool(chunks and not chunks[-1].get("choices") and chunks[-1].get("usage"))
        out["finish_reason"] = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]
        return out
    try:
        j = r.json()
    except ValueError:
        out["body"] = r.text[:200]
        return out
    if r.status_code == 200:
        ch = j["choices"][0]
        out["text"] = ch["message"]["content"] if route == "chat" else ch["text"]
        out["finish_reason"] = ch["finish_reason"]
        out["usage"] = j.get("usage")
        out["fields"] = sorted(_fields(j))
        lp = ch.get("logprobs")
        if lp and route == "chat":
            out["logprobs"] = [x["logprob"] for x in lp["content"]]
        elif lp:
            out["logprobs"] = lp["token_logprobs"]
    else:
        err = j.get("error") if isinstance(j.get("error"), dict) else j
        out["message"] = str(err.get("message", err.get("detail", j)))[:300]
    return out


def _wait(base: str, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{base} did not come up in {timeout:.0f} s")


def start_vllm(python: Path, target_dir: str, model_name: str, port: int, log: Path, threads: int = 1):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    iomp = sorted(python.parent.parent.glob("lib/libiomp5.so"))
    if iomp:
        env["LD_PRELOAD"] = str(iomp[0])
    f = open(log, "w")
    return subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                             "--served-model-name", model_name, "--dtype", "float32"],
                            stdout=f, stderr=subprocess.STDOUT, env=env)


def compare(ours: dict, theirs: dict, greedy: bool) -> dict:
    row = {"same_status": ours["status"] == theirs["status"]}
    if ours["status"] == theirs["status"] == 200:
        if greedy:
            row["same_text"] = ours.get("text") == theirs.get("text")
        row["fields_only_ours"] = sorted(set(ours.get("fields", [])) - set(theirs.get("fields", [])))
        row["fields_only_vllm"] = sorted(set(theirs.get("fields", [])) - set(ours.get("fields", [])))
        if ours.get("usage") and theirs.get("usage"):
            row["same_usage"] = ours["usage"] == {k: theirs["usage"][k] for k in ours["usage"]}
        if ours.get("logprobs") and theirs.get("logprobs"):
            pairs = [(x, y) for x, y in zip(ours["logprobs"], theirs["logprobs"]) if x is not None and y is not None]
            row["logprobs_counts"] = [len(ours["logprobs"]), len(theirs["logprobs"])]
            if pairs:
                row["logprob_max_abs_diff"] = max(abs(x - y) for x, y in pairs)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = parser("openai_conformance", __doc__)
    ap.add_argument("--publish", default=None, help="our server's publish directory (drafter)")
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-url", default=None, help="a running vLLM OpenAI server (else one is started)")
    ap.add_argument("--vllm-port", type=int, default=8123)
    ap.add_argument("--quick", action="store_true", help="a few requests of each kind (for the test)")
    add_common_args(ap, threads=True, threads_default=1)
    b = setup(ap.parse_args(argv), layout=False)
    a, target, out = b.args, b.target, b.out
    name = target.name
    proc = None
    if a.vllm_url:
        vbase = a.vllm_url.rstrip("/")
    else:
        python = vllm_python(a.vllm_python)
        if python is None:
            raise SystemExit("no vLLM environment (.venv-vllm): run `bash scripts/vllm_env.sh` or pass --vllm-url")
        proc = start_vllm(python, str(target.path), name, a.vllm_port, out / "vllm.log", a.threads)
        vbase = f"http://127.0.0.1:{a.vllm_port}"
    svc = DecodingService(target, publish_dir=a.publish, tree=a.tree, max_batch=a.max_batch, model_name=name)
    server, port = serve_in_thread(svc)
    obase = f"http://127.0.0.1:{port}"
    good, bad = (GOOD[:4] + GOOD[11:13], BAD[:8]) if a.quick else (GOOD, BAD)
    rows = []
    try:
        _wait(vbase, 900)
        for feat, route, body, spec in good:
            body = {"model": name, **body}
            greedy = "temperature" not in body
            if greedy:
                body["temperature"] = 0
            o, v = _post(obase, route, body), _post(vbase, route, body)
            rows.append({"feature": feat, "route": route, "openai_api": spec, "ours": o, "vllm": v,
                         **compare(o, v, greedy)})
            print(f"{feat:40s} ours {o['status']} vLLM {v['status']} text equal: {rows[-1].get('same_text')}",
                  flush=True)
        for feat, route, change, spec in bad:
            base = {"model": name, "max_tokens": 4, "temperature": 0,
                    **({"messages": M1} if route == "chat" else {"prompt": "Hello"})}
            body = None if change is None else {**base, **change}
            o, v = _post(obase, route, body), _post(vbase, route, body)
            rows.append({"feature": f"bad: {feat}", "route": route, "openai_api": spec, "ours": o, "vllm": v,
                         **compare(o, v, False)})
            print(f"bad: {feat:35s} ours {o['status']} vLLM {v['status']}", flush=True)
    finally:
        server.should_exit = True
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    report = {"ours": {"drafter": svc.version, "tree": a.tree, "max_batch": a.max_batch}, "vllm": vbase,
              "rows": rows}
    write_json(out / "conformance.json", report)
    (out / "conformance.md").write_text(markdown(rows))
    return report


def markdown(rows: list[dict]) -> str:
    lines = ["| feature | ours | vLLM 0.32 | OpenAI API | same greedy text | fields only ours / only vLLM |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        def cell(x):
            s = str(x["status"])
            if x["status"] != 200 and x.get("message"):
                s += ": " + x["message"][:70].replace("|", "/").replace("\n", " ")
            return s
        fields = ""
        if "fields_only_ours" in r:
            fields = f"{', '.join(r['fields_only_ours']) or '-'} / {', '.join(r['fields_only_vllm']) or '-'}"
        same = {True: "yes", False: "NO", None: ""}[r.get("same_text")]
        if r.get("logprob_max_abs_diff") is not None:
            same += f" (logprob diff {r['logprob_max_abs_diff']:.1e})"
        lines.append(f"| {r['feature']} | {cell(r['ours'])} | {cell(r['vllm'])} | {r['openai_api']} | {same} | "
                     f"{fields} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
