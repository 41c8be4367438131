"""Runs in vLLM's own environment (``.venv-vllm``, see scripts/vllm_env.sh), not in draftsmith's: it imports
only vLLM and the standard library. `draftsmith.export.vllm_check` starts it once per configuration.

    .venv-vllm/bin/python export/vllm_worker.py JOB.json OUT.json

JOB.json: ``{"target": DIR, "prompts": [[ids...], ...], "max_tokens": N, "speculative_config": {...} | null,
"max_model_len": 2048, "threads": 1}``, optionally ``"enforce_eager": false`` (vLLM's compiled mode; default true),
``"dtype"`` (default float32) and ``"batched": true`` (every prompt in one ``generate`` call, vLLM batching them).
OUT.json: the generated token ids per prompt, wall time, generated
tokens, and vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted per position).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _counters(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        name = getattr(m, "name", "")
        if not name.startswith("vllm:spec_decode"):
            continue
        key = name.removeprefix("vllm:spec_decode_")
        if hasattr(m, "values"):  # a vector (accepted tokens per position)
            out[key] = [float(v) for v in m.values]
        else:
            out[key] = float(getattr(m, "value", 0.0))
    return out


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    threads = int(job.get("threads") or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from vllm import LLM, SamplingParams  # the vLLM environment only
    from vllm.inputs import TokensPrompt

    kw = {"model": job["target"], "dtype": job.get("dtype", "float32"), "max_model_len": int(job.get("max_model_len",
          2048)), "disable_log_stats": False, "seed": 0, "enforce_eager": bool(job.get("enforce_eager", True))}
    if job.get("speculative_config"):
        kw["speculative_config"] = job["speculative_config"]
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up, not timed
    before = _counters(llm)
    t0 = time.perf_counter()
    outs = []
    if job.get("batched"):
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        for p in prompts:  # one request at a time: batch size 1, as our decoder runs
            outs.append(llm.generate([p], sp, use_tqdm=False)[0])
    wall = time.perf_counter() - t0
    after = _counters(llm)
    spec = {}
    for k, v in after.items():
        b = before.get(k)
        spec[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) and b else (v - b if b is not None else v)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    json.dump({"tokens": tokens, "wall_s": wall, "generated": sum(len(t) for t in tokens), "spec": spec,
               "config": {k: v for k, v in kw.items() if k != "model"}}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
