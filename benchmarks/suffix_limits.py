"""SuffixDecoding's index costs: memory per million indexed tokens, lookup time, and pathological inputs.

* memory: a global `SuffixIndex` over ``--tokens`` tokens of real text (the Python standard library's
  source, tokenized with the target's tokenizer, cut into responses of ``--response-len`` tokens), its
  own accounting (`SuffixIndex.memory_report`) and the process's traced allocations (tracemalloc);
* lookup: time per ``speculate`` (per-request index of a 512-token context plus the global index) at
  contexts taken from held-out text of the same source;
* pathological: a response of ``--run`` copies of one token in the global index and a context of the same
  token; a prompt of ``--run`` tokens (the per-request index built at once) and of one repeated token;
  each with its build time per token, lookup time and memory.

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.suffix_limits --out runs/suffix/limits.json
"""

from __future__ import annotations

import random
import sysconfig
import time
import tracemalloc
from pathlib import Path

from benchmarks.common import add_common_args, parser, provenance, write_json
from draftsmith.drafters.suffix import SuffixConfig, SuffixIndex, TokenIndex
from draftsmith.target import load_target


def corpus(tok, n: int, seed: int = 0) -> list[int]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(seed).shuffle(files)
    out: list[int] = []
    for f in files:
        try:
            out += tok.encode(f.read_text(errors="ignore"), add_special_tokens=False)
        except (OSError, ValueError):
            continue
        if len(out) >= n:
            break
    return out[:n]


def timed_lookups(fn, contexts) -> float:
    t0 = time.perf_counter()
    for c in contexts:
        fn(c)
    return 1e6 * (time.perf_counter() - t0) / len(contexts)


def main(argv=None) -> dict:
    ap = parser("suffix_limits", __doc__)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--run", type=int, default=100_000, help="length of the pathological inputs")
    add_common_args(ap, out="file")
    a = ap.parse_args(argv)
    tok = load_target(a.target).tokenizer
    text = corpus(tok, a.tokens + 200_000)
    train, held = text[: a.tokens], text[a.tokens:]
    cfg = SuffixConfig(max_cached_requests=1_000_000)
    report: dict = {**provenance(), "config": vars(a)}

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    g = SuffixIndex(cfg)
    for i in range(0, len(train), a.response_len):
        g.add_response(train[i:i + a.response_len])
    build = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    rep = g.memory_report()
    rep.update(build_s=round(build, 2), build_us_per_token=round(1e6 * build / len(train), 2),
               traced_bytes=traced, traced_bytes_per_million_tokens=round(traced / len(train) * 1e6))
    report["memory"] = rep
    print("global index:", rep, flush=True)

    rng = random.Random(0)
    starts = [rng.randrange(512, len(held) - 1) for _ in range(a.lookups)]
    contexts = [held[s - 512:s] for s in starts]
    local = TokenIndex(cfg)
    local.extend(held[:512])
    us_global = timed_lookups(lambda c: g.speculate(c), contexts)
    drafts = [g.speculate(c) for c in contexts[:500]]
    us_local = timed_lookups(lambda c: local.speculate(c), contexts)
    report["lookup"] = {"global_us": round(us_global, 1), "local_512_us": round(us_local, 1),
                        "mean_draft_len": sum(len(d) for d in drafts) / len(drafts),
                        "mean_match_len": sum(d.match_len for d in drafts) / len(drafts)}
    print("lookup:", report["lookup"], flush=True)

    patho = {}
    one = [tok.encode(" the", add_special_tokens=False)[0]] * a.run
    for name, seq in (("global run of one token", one),):
        tracemalloc.start()
        t0 = time.perf_counter()
        p = SuffixIndex(SuffixConfig(max_response_tokens=a.run))
        p.add_response(seq)
        b = time.perf_counter() - t0
        mem = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        us = timed_lookups(lambda c: p.speculate(c), [one[:100]] * 200)
        d = p.speculate(one[:100])
        patho[name] = {"tokens": len(seq), "build_us_per_token": round(1e6 * b / len(seq), 2),
                       "lookup_us": round(us, 1),
                       "draft_len": len(d), "traced_bytes": mem, "index_bytes": p.index.memory_bytes()}
    huge = held[: a.run]
    for name, seq in (("prompt of real text", huge), ("prompt of one token", one)):
        tracemalloc.start()
        t0 = time.perf_counter()
        ix = TokenIndex(cfg)
        ix.extend(seq)
        b = time.perf_counter() - t0
        mem = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        us = timed_lookups(lambda c: ix.speculate(c), [seq[-512:]] * 200)
        patho[name] = {"tokens": len(seq), "build_us_per_token": round(1e6 * b / len(seq), 2),
                       "lookup_us": round(us, 1),
                       "traced_bytes": mem, "index_bytes": ix.memory_bytes()}
    report["pathological"] = patho
    for k, v in patho.items():
        print(k, v, flush=True)
    write_json(a.out, report)
    print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    main()
