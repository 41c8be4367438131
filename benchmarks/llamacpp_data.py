"""llama.cpp's server as the self-distillation data backend, against our data engine, on the same conversations.

    python -m benchmarks.llamacpp_data [--conversations 64] [--max-new-tokens 128] [--threads 2]
        [--parallel 1,4,8] [--gguf-type q4_1] [--engine-dtype float32] --out DIR

The same prompts (the distinct first turns of the ShareGPT sample the recipes use) are answered greedily:
  * by our data engine (`draftsmith.train.data.generate.regenerate`, continuous batching, the recipes' 96 rows), in
    ``--engine-dtype``;
  * by ``llama-server`` on the target's GGUF (``--gguf-type``; q4_1 is the shipped file) with N parallel slots
    and N requests in flight, through the OpenAI-compatible backend the data stage uses (`train/data/remote.py`,
    identity check ``models``: a 4-bit file's greedy tokens are not the fp32 model's).
Printed: response tokens per second of each, and how many responses are token-for-token those of our engine
(the fp32 target's greedy answers), with the first differing position.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.checkpoint import command_line, environment
from draftsmith.export.llamacpp import find_llamacpp, target_gguf
from draftsmith.export.llamacpp_server import LlamaServer
from draftsmith.target import DEFAULT_TARGET, cpu_name, load_target
from draftsmith.train.data import generate, remote, sources


def responses(path: Path, tokenizer) -> dict[str, list[int]]:
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        text = next((m["content"] for m in row["messages"] if m["role"] == "assistant"), "")
        out[row["id"]] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--conversations", type=int, default=52)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", default="1,4,8", help="llama-server slots (= requests in flight), comma list")
    ap.add_argument("--gguf-type", default="q4_1")
    ap.add_argument("--engine-dtype", default="float32")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ll = find_llamacpp()
    target = load_target(a.target, dtype=a.engine_dtype)
    skips = sources.SkipLog()
    convs, seen = [], set()
    for c in sources.read_sharegpt(sources.resolve_path("builtin:sharegpt-dummy"), "sharegpt", skips):
        if c.user_turns[0] not in seen:  # the sample repeats conversations
            seen.add(c.user_turns[0])
            convs.append(sources.Conversation(c.id, c.source, c.user_turns[:1], c.system))
    convs = convs[: a.conversations]
    kw = dict(max_new_tokens=a.max_new_tokens, max_turns=1, max_seq_len=1024, temperature=0.0)
    report: dict = {"cpu": cpu_name(), "threads": a.threads, "conversations": len(convs), "runs": {},
                    "command": command_line(), "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads; {len(convs)} conversations x <= {a.max_new_tokens} tokens")
    f = out / "engine.jsonl"
    f.unlink(missing_ok=True)
    generate.regenerate(target, convs[:4], out / "warmup.jsonl", batch_size=16, **kw)  # compile outside the clock
    t0 = time.perf_counter()
    st = generate.regenerate(target, convs, f, batch_size=16, **kw)
    wall = time.perf_counter() - t0
    ref = responses(f, target.tokenizer)
    report["runs"][f"ours ({a.engine_dtype}, batched engine)"] = {
        "response_tokens": st["response_tokens"], "wall_s": wall, "tok_s": st["response_tokens"] / wall}
    print(f"ours: {st['response_tokens'] / wall:.1f} response tok/s", flush=True)
    gguf = target_gguf(target, a.gguf_type, ll)
    for n in [int(x) for x in a.parallel.split(",") if x]:
        f = out / f"llamacpp-np{n}.jsonl"
        f.unlink(missing_ok=True)
        with LlamaServer(gguf, threads=a.threads, parallel=n, ctx=1536, ll=ll, log=out / f"server-np{n}.log",
                         extra=["--alias", target.name]) as s:
            t0 = time.perf_counter()
            st = remote.regenerate_remote(target, convs, f, url=s.url, model=target.name, concurrency=n,
                                          check="models", on_long_prompt="skip", **kw)
            wall = time.perf_counter() - t0
        got = responses(f, target.tokenizer)
        same = sum(got.get(k) == v for k, v in ref.items())
        report["runs"][f"llama.cpp {a.gguf_type}, {n} slots"] = {
            "response_tokens": st["response_tokens"], "wall_s": wall, "tok_s": st["response_tokens"] / wall,
            "responses_equal_to_ours": same, "of": len(ref)}
        print(f"llama.cpp {a.gguf_type} {n} slots: {st['response_tokens'] / wall:.1f} response tok/s; "
              f"{same}/{len(ref)} responses equal to ours", flush=True)
    (out / "llamacpp_data.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
