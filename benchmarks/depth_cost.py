"""Decoding alone, prefill left out, at two context depths: ms a token of our compiled plain decoding and of
llama.cpp on the file the target ships as, for prompts that stay within a sliding window and prompts past it
(Gemma 3's 512), or any two depths.

    python -m benchmarks.depth_cost --target gemma-3-270m [--depths 300,650] [--prompts 4] [--max-new-tokens 128]
        [--rounds 2] [--threads 2] [--no-llamacpp] --out FILE

Prompts of at least each depth's tokens (`draftsmith.eval.humaneval.long_prompt_ids`: HumanEval's stubs one after
another). Ours: per prompt, the wall time of a 1-token generation (prefill and first token) subtracted from a
``--max-new-tokens`` one's, float32 on the compiled forward (`SpeculativeDecoder`, plain). llama.cpp: its own
``predicted_ms`` (``llama-server`` on the shipped GGUF, `draftsmith.export.llamacpp_server`), which leaves the
prompt's processing out. Both in one process, alternating per depth and round; each round prints its figures and
the report keeps every round (the machine is shared and noisy: compare within a round).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import add_common_args, parser, provenance, setup, write_json
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.eval.humaneval import long_prompt_ids
from draftsmith.export.llamacpp_server import LlamaServer, run_prompts
from draftsmith.target import cpu_name
from draftsmith.targets import shipped_gguf


def ours_ms(dec: SpeculativeDecoder, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """(ms a token after the first, mean seconds of a prompt's prefill and first token)."""
    pre = rest = 0.0
    toks = 0
    for p in prompts:
        first = dec.generate(p, 1)
        r = dec.generate(p, n)
        pre += first.wall_s
        rest += r.wall_s - first.wall_s
        toks += len(r.tokens) - 1
    return 1e3 * rest / max(toks, 1), pre / len(prompts)


def main(argv=None) -> dict:
    ap = parser("depth_cost", __doc__)
    ap.add_argument("--depths", default="300,650", help="comma list of prompt lengths, in tokens (at least)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true", help="ours only")
    add_common_args(ap, threads=True, threads_default=2, out="file")
    b = setup(ap.parse_args(argv), out_file=True, layout=False)
    a, target = b.args, b.target
    use_fast_forward(target, "compile")
    dec = SpeculativeDecoder(target)
    sets = {int(d): long_prompt_ids(target.tokenizer, a.prompts, int(d)) for d in a.depths.split(",")}
    for ids in sets.values():
        dec.generate(ids[0], 16)  # compile every path the depths take
    report = {"cpu": cpu_name(), "threads": a.threads, "target": target.name, "max_new_tokens": a.max_new_tokens,
              "prompt_tokens": {d: [len(p) for p in ids] for d, ids in sets.items()}, "rounds": [], **provenance()}
    with ExitStack() as stack:
        server = None
        if not a.no_llamacpp:
            shipped = shipped_gguf(target.name, target.path)
            if shipped is None:
                raise SystemExit(f"{target.name} ships no GGUF file: run with --no-llamacpp")
            server = stack.enter_context(LlamaServer(shipped[0], threads=a.threads,
                                                     log=Path(a.out).with_suffix(".llamacpp.log")))
        for rnd in range(a.rounds):
            row = {}
            for d, ids in sets.items():
                ms, pre = ours_ms(dec, ids, a.max_new_tokens)
                row[d] = {"ours_ms_per_token": round(ms, 2), "ours_prefill_s": round(pre, 3)}
                if server is not None:
                    ll = run_prompts(server, ids, a.max_new_tokens, warmup=rnd == 0)
                    row[d]["llamacpp_ms_per_token"] = round(ll["decode_ms"] / ll["generated"], 2)
                print(f"round {rnd + 1}, prompts of {min(len(p) for p in ids)}-{max(len(p) for p in ids)} tokens: "
                      f"{row[d]}", flush=True)
            report["rounds"].append(row)
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
