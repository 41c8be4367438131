"""Benchmark of the training pipeline, every ratio measured side by side in one run.

    python -m benchmarks.bench_pipeline [--prompts 16] [--new-tokens 64] [--train-steps 30]

Prints and writes (``--out``, JSON):
  * the self-distillation data path: response tokens/s of ``regenerate`` with the
    continuous-batching engine over the reference engine (Hugging Face
    ``generate`` on padded batches of ``--hf-batch``, the data stage before it),
    same conversations, same budget, and how many responses are identical
    (goal >= 2.5x, 4x);
  * batched generation tokens/s over single-sequence ``generate`` (goal >= 3x);
  * caching-pass tokens/s over a bare target forward on the same tokens and
    batches (goal >= 0.9x);
  * the share of head-training wall time spent outside model math (goal <= 10%).

``--fused-cache`` times the data and cache stages together instead, on the same conversations: (a) the
batched engine + the separate cache pass, (b) the batched engine writing the cache from its own states
(``data.fused_cache``; the cache stage then only checks the shards), (c) Hugging Face ``generate`` + the
separate cache pass (the old pipeline); response tokens/s over the whole of each, and the ratios. The
caches of (a) and (b) are compared (tokens exactly, states' largest difference).
Prompts are MT-Bench first turns (timing only; nothing is trained on them
except inside this throw-away benchmark directory).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import add_common_args, parser, setup, write_json
from benchmarks.fastest_plain import cpu_name as _cpu_name
from draftsmith.checkpoint import environment


def _data_path(target, convs, new_tokens: int, hf_batch: int, rows: int, repeats: int,
               names: tuple[str, ...] = ("hf", "masked", "batched"), forward: str = "compile") -> dict:
    """regenerate() with each engine on the same conversations, alternating; best of each kept.

    Engines: ``hf`` (the reference path, Hugging Face ``generate`` on padded batches), ``masked``
    (continuous batching through the model's own forward as it was before per-row attention and
    shared-prefix prefill: each decode step one masked attention call over the longest live row's span,
    every prompt prefilled whole), ``eager`` (the model's own forward with per-row attention where rows'
    lengths differ, ``attention="auto"``, and the prompts' common prefix computed once) and ``batched``
    (the engine as the data stage runs it: ``eager``'s prefills and, for decode steps, ``forward``: by
    default the compiled step of `draftsmith.engine.fast_batch`, compiled before the timing starts by a
    warm-up run on 4 conversations, whose seconds are reported as ``batched_compile_s``).
    """
    from draftsmith.engine.fast_batch import batch_body
    from draftsmith.engine.native import native_available, native_status
    from draftsmith.train.data.generate import regenerate
    res: dict = {"conversations": len(convs), "max_new_tokens": new_tokens, "hf_batch": hf_batch, "rows": rows,
                 "forward": forward}
    engines = {"hf": ("hf", "auto", True, "eager"), "masked": ("batched", "masked", False, "eager"),
               "eager": ("batched", "auto", True, "eager"), "batched": ("batched", "auto", True, forward)}
    engines = {k: v for k, v in engines.items() if k in names}
    best = {k: 0.0 for k in engines}
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "batched" in engines and forward != "eager":
            native_available()
            res["native"] = native_status()
            t0 = time.perf_counter()
            regenerate(target, convs[:4], Path(tmp) / "warmup.jsonl", max_new_tokens=8, max_turns=1, batch_size=4,
                       max_seq_len=4096, on_long_prompt="skip", engine="batched", max_rows=rows, forward=forward)
            body = batch_body(target.model, forward)
            res["batched_compile_s"] = round(body.compile_s if body is not None else 0.0, 1)
            print(f"  batched: decode step {forward}, warm-up {time.perf_counter() - t0:.1f} s (compiling "
                  f"{res['batched_compile_s']} s); native attention: {res['native']}", flush=True)
        for r in range(repeats):
            for name, (engine, attention, share, fwd) in engines.items():
                path = Path(tmp) / f"{name}{r}.jsonl"
                t0 = time.perf_counter()
                st = regenerate(target, convs, path, max_new_tokens=new_tokens, max_turns=1, batch_size=hf_batch,
                                max_seq_len=4096, on_long_prompt="skip", engine=engine, max_rows=rows,
                                attention=attention, shared_prefix=share, forward=fwd)
                dt = time.perf_counter() - t0
                best[name] = max(best[name], st["response_tokens"] / dt)
                res[f"{name}_response_tokens"] = st["response_tokens"]
                res[f"{name}_seconds"] = round(dt, 1)
                outs[name] = {json.loads(x)["id"]: json.loads(x)["messages"] for x in path.read_text().splitlines()}
                print(f"  {name}: {best[name]:.1f} response tok/s", flush=True)
    res["outputs"] = outs
    res.update({f"{k}_tokens_per_s": v for k, v in best.items()})
    res["responses"] = len(next(iter(outs.values())))
    if "hf" in outs and "batched" in outs:
        res.update({"ratio": best["batched"] / best["hf"], "goal": ">= 2.5 (4)",
                    "identical_responses": sum(outs["hf"].get(k) == v for k, v in outs["batched"].items())})
    if "hf" in outs and "masked" in outs:
        res.update({"ratio_masked": best["masked"] / best["hf"],
                    "identical_responses_masked": sum(outs["hf"].get(k) == v for k, v in outs["masked"].items())})
    if "masked" in outs and "batched" in outs:
        res["engine_gain"] = best["batched"] / best["masked"]
    if "eager" in outs and "batched" in outs:
        res["batched_over_eager"] = best["batched"] / best["eager"]
        res["identical_responses_eager"] = sum(outs["eager"].get(k) == v for k, v in outs["batched"].items())
    return res


def _more_pairs(d: dict, args, target, convs, names, vpath: Path, dtype: str) -> None:
    """Pairs 2..N of (our engines, vLLM), each run as the first pair was; every pair's ratio into ``d["pairs"]``."""
    import statistics
    key = "batched" if "batched" in names else names[-1]
    def pair(ours: float, vllm: float) -> dict:
        return {"ours": ours, "vllm": vllm, "ratio": ours / vllm}

    pairs = [pair(d[f"{key}_tokens_per_s"], d["vllm"]["tokens_per_s"])]
    for r in range(1, args.pairs):
        o = _data_path(target, convs, args.data_new_tokens, args.hf_batch, args.rows, 1, names, args.forward)
        v = _vllm_data(target, convs, args.data_new_tokens, None, vpath.with_name(f"{vpath.stem}.pair{r}.json"),
                       torch.get_num_threads(), dtype)
        pairs.append(pair(o[f"{key}_tokens_per_s"], v["tokens_per_s"]))
        print(f"pair {r + 1}: {key} {pairs[-1]['ours']:.1f}, vLLM {pairs[-1]['vllm']:.1f} response tok/s: "
              f"{pairs[-1]['ratio']:.2f}x", flush=True)
    ratios = [p["ratio"] for p in pairs]
    d["pairs"] = pairs
    d["pairs_ratio_median"], d["pairs_ratio_min"] = statistics.median(ratios), min(ratios)
    print(f"{len(pairs)} pairs, {key} / vLLM: " + ", ".join(f"{x:.2f}x" for x in ratios) +
          f"; median {d['pairs_ratio_median']:.2f}x, lowest {d['pairs_ratio_min']:.2f}x", flush=True)


def _vllm_data(target, convs, new_tokens: int, ours: dict | None, out: Path, threads: int, dtype: str) -> dict:
    """vLLM on CPU over the same conversations' prompts (one batched ``generate``, greedy, same budget): response
    tokens/s, and how many responses equal our batched engine's (text of the assistant turn)."""
    from draftsmith.export.vllm_check import run_vllm, vllm_python
    from draftsmith.train.data.generate import prompt_ids
    py = vllm_python(None)
    if py is None:
        return {"skipped": "no .venv-vllm (bash scripts/vllm_env.sh builds it)"}
    tok = target.tokenizer
    ids = [prompt_ids(tok, [{"role": "user", "content": c.user_turns[0]}]) for c in convs]
    r = run_vllm(py, str(target.path), ids, new_tokens, out, threads=threads,
                 extra={"dtype": dtype, "batched": True})
    texts = {c.id: tok.decode(t, skip_special_tokens=True).strip() for c, t in zip(convs, r["tokens"])}
    res = {"response_tokens": r["generated"], "seconds": round(r["wall_s"], 1),
           "tokens_per_s": r["generated"] / r["wall_s"]}
    if ours:
        mine = {k: (m[-1]["content"] if m and m[-1]["role"] == "assistant" else None) for k, m in ours.items()}
        res["identical_to_ours"] = sum(mine.get(k) is not None and mine[k].strip() == v for k, v in texts.items())
    return res


@torch.no_grad()
def _roofline(target, repeats: int = 5) -> dict:
    """Every linear layer of the target (the LM head included) on random inputs of M tokens, best of
    ``repeats``: a ceiling on the tokens per second any engine processes in this precision on this machine
    (attention, norms and sampling taken as free)."""
    weights = [m.weight for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    flop = 2 * sum(w.numel() for w in weights)
    shapes = []
    for m in (32, 96, 160, 512):
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w in weights:
                xs[w.shape[1]] @ w.T
            best = min(best, time.perf_counter() - t0)
        shapes.append({"tokens": m, "tokens_per_s": m / best, "gflops": flop * m / best / 1e9})
    return {"flop_per_token": flop, "shapes": shapes}


def _fused_path(target, convs, new_tokens: int, hf_batch: int, rows: int, repeats: int, batch_tokens: int,
                shard_tokens: int) -> dict:
    """Generation + cache stage, three ways, alternating (the order rotates per repeat); best of each kept."""
    import numpy as np
    from draftsmith.pipeline.stages import load_sequences
    from draftsmith.common.hidden_cache import HiddenCache
    from draftsmith.train.data.cache import build_cache
    from draftsmith.train.data.generate import FusedCacheWriter, regenerate
    modes = ["batched+cache", "fused", "hf+cache"]
    best: dict = {}
    res: dict = {"conversations": len(convs), "max_new_tokens": new_tokens, "hf_batch": hf_batch, "rows": rows}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for mode in modes[r % 3:] + modes[:r % 3]:
                d = Path(tmp) / f"{mode}{r}"
                d.mkdir()
                t0 = time.perf_counter()
                st = regenerate(target, convs, d / "train.jsonl", max_new_tokens=new_tokens, max_turns=1,
                                batch_size=hf_batch, max_seq_len=4096, on_long_prompt="skip",
                                engine="hf" if mode == "hf+cache" else "batched", max_rows=rows,
                                fused=(FusedCacheWriter(d / "cache", shard_tokens=shard_tokens) if mode == "fused"
                                       else None))
                t1 = time.perf_counter()
                seqs = load_sequences(d / "train.jsonl", target.tokenizer, 4096)
                idx = build_cache(target, seqs, ["final"], d / "cache", dtype="float16", batch_tokens=batch_tokens,
                                  shard_tokens=shard_tokens)
                t2 = time.perf_counter()
                row = {"generation_s": t1 - t0, "cache_s": t2 - t1, "total_s": t2 - t0,
                       "response_tokens": st["response_tokens"], "cache_tokens": idx["tokens"],
                       "response_tokens_per_s": st["response_tokens"] / (t2 - t0),
                       "states": idx["provenance"]["states"],
                       "fallbacks": {k: v for k, v in st.items() if k.startswith("fused_fallback_")}}
                if mode not in best or row["response_tokens_per_s"] > best[mode]["response_tokens_per_s"]:
                    best[mode] = {**row, "dir": str(d / "cache")}
        a, b = HiddenCache(best["batched+cache"]["dir"]), HiddenCache(best["fused"]["dir"])
        same = len(a) == len(b) and all(np.array_equal(a.tokens(i), b.tokens(i))
                                        and np.array_equal(a.mask(i), b.mask(i))
                                        for i in range(len(a)))
        diff = max(float((a.states(i, "final") - b.states(i, "final")).abs().max())
                   for i in range(len(a))) if same else None
    for v in best.values():
        v.pop("dir")
    res.update(best)
    res.update({"fused_over_batched_cache": best["fused"]["response_tokens_per_s"] /
                best["batched+cache"]["response_tokens_per_s"],
                "fused_over_hf_cache": best["fused"]["response_tokens_per_s"] /
                best["hf+cache"]["response_tokens_per_s"],
                "batched_cache_over_hf_cache": best["batched+cache"]["response_tokens_per_s"] /
                best["hf+cache"]["response_tokens_per_s"],
                "fused_cache_tokens_identical": same, "fused_cache_max_state_diff": diff})
    return res


def _gen_tokens_per_s(target, prompts, new_tokens, batched: bool) -> tuple[float, list]:
    from draftsmith.train.data.generate import generate_batch
    t0 = time.perf_counter()
    if batched:
        outs = generate_batch(target, prompts, new_tokens)
    else:
        outs = [generate_batch(target, [p], new_tokens)[0] for p in prompts]
    dt = time.perf_counter() - t0
    return sum(len(o[0]) for o in outs) / dt, outs


@torch.no_grad()
def _bare_forward(target, seqs, batch_tokens) -> float:
    from draftsmith.train.data.cache import pad_batch, token_batches
    lens = [len(s["ids"]) for s in seqs]
    t0 = time.perf_counter()
    for b in token_batches(lens, batch_tokens):
        ids, attn = pad_batch([seqs[j]["ids"] for j in b])
        target.model(input_ids=ids, attention_mask=attn, use_cache=False)
    return sum(lens) / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = parser("bench_pipeline", __doc__)
    add_common_args(ap, threads=True, out="file", out_required=False)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--data-prompts", type=int, default=128, help="conversations for the data-path comparison "
                    "(ShareGPT sample, MT-Bench first turns, then HumanEval: up to 296; timing only)")
    ap.add_argument("--data-new-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=32, help="reference engine's batch (the recipes' data.batch_size)")
    ap.add_argument("--rows", type=int, default=96, help="batched engine's rows in flight")
    ap.add_argument("--only-data", action="store_true", help="run only the data-path comparison")
    ap.add_argument("--roofline", action="store_true", help="time the target's linear layers alone at 32, 96, 160 "
                    "and 512 tokens per forward: the most tokens/s any engine could process in this precision")
    ap.add_argument("--fused-cache", action="store_true", help="run only the data+cache comparison: batched "
                    "generation + separate cache pass vs fused generation+cache vs HF generate + separate cache pass")
    ap.add_argument("--shard-tokens", type=int, default=200_000, help="--fused-cache: tokens per cache shard")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats of each pair; best of each kept")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="the target's dtype for every engine (auto: bf16 where the CPU computes it natively)")
    ap.add_argument("--vllm", action="store_true", help="--only-data: also vLLM on CPU (.venv-vllm, "
                    "scripts/vllm_env.sh), every conversation's prompt in one batched generate, same budget")
    ap.add_argument("--pairs", type=int, default=1, help="--only-data --vllm: run our engines then vLLM this many "
                    "times in turn (the machine's speed drifts between runs; each pair's ratio is reported, and "
                    "their median and lowest)")
    ap.add_argument("--engines", default="hf,masked,batched",
                    help="data path: the engines to run, of hf, masked, eager, batched (default: hf,masked,batched)")
    ap.add_argument("--forward", default="compile", choices=["eager", "fast", "compile"],
                    help="data path: the batched engine's decode step (the data stage's data.forward)")
    args = ap.parse_args(argv)
    bench = setup(args, out_file=True, load=False)
    from draftsmith.target import load_target, resolve_dtype
    choice = resolve_dtype(args.dtype, "cpu")
    target = bench.target = load_target(args.target, dtype=choice.dtype)

    from draftsmith.recipe import parse_recipe
    from draftsmith.train.data.cache import build_cache
    from draftsmith.common.chat import render_example
    from draftsmith.train.data.generate import prompt_ids
    from draftsmith.train.data.sources import mtbench_questions
    from draftsmith.train.training.trainer import train

    if args.roofline:
        res = {"environment": environment(), "threads": torch.get_num_threads(), "roofline": _roofline(target)}
        for r in res["roofline"]["shapes"]:
            print(f"linear layers only, {r['tokens']} tokens per forward: {r['tokens_per_s']:.0f} tokens/s "
                  f"({r['gflops']:.1f} GFLOP/s)")
        print(f"{res['roofline']['flop_per_token'] / 1e6:.0f} MFLOP of linear layers per token, "
              f"{res['threads']} threads", flush=True)
        if args.out:
            write_json(args.out, res)
        return res
    tok = target.tokenizer
    qs = mtbench_questions()[: args.prompts]
    prompts = [prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}]) for q in qs]
    res: dict = {"environment": environment(), "prompts": len(prompts), "new_tokens": args.new_tokens,
                 "threads": torch.get_num_threads()}

    # 0. the data stage's generation: reference engine vs continuous batching
    from draftsmith.train.data.sources import Conversation, SkipLog, normalise, read_sharegpt, resolve_path
    pool, seen = [], set()
    try:  # after the first 128 (ShareGPT sample, MT-Bench): HumanEval's 164 problems, for --data-prompts up to 296
        from benchmarks.common import humaneval_messages
        coding = [Conversation(f"humaneval:{k}", "humaneval", [m[0]["content"]]) for k, m in humaneval_messages()]
    except ImportError:
        coding = []
    for c in list(read_sharegpt(resolve_path("builtin:sharegpt-dummy"), "sharegpt", SkipLog())) + [
            Conversation(f"mtbench:{q['question_id']}", "mtbench", [q["turns"][0]])
            for q in mtbench_questions()] + coding:
        if normalise(c.user_turns[0]) not in seen:
            seen.add(normalise(c.user_turns[0]))
            pool.append(Conversation(c.id, c.source, c.user_turns[:1]))
    if args.fused_cache:
        f = res["fused_cache"] = _fused_path(target, pool[: args.data_prompts], args.data_new_tokens, args.hf_batch,
                                             args.rows, args.repeats, args.batch_tokens, args.shard_tokens)
        for mode in ("batched+cache", "fused", "hf+cache"):
            m = f[mode]
            print(f"{mode:14s} {m['response_tokens_per_s']:7.1f} response tok/s over data+cache "
                  f"({m['response_tokens']} response tokens, {m['cache_tokens']} cached tokens; generation "
                  f"{m['generation_s']:.1f} s + cache stage {m['cache_s']:.1f} s = {m['total_s']:.1f} s; states from "
                  f"generation {m['states']['from_generation']}, computed {m['states']['forward'] or 'none'})")
        print(f"fused / batched+cache {f['fused_over_batched_cache']:.2f}x; fused / hf+cache "
              f"{f['fused_over_hf_cache']:.2f}x; batched+cache / hf+cache {f['batched_cache_over_hf_cache']:.2f}x; "
              f"fused cache tokens identical: {f['fused_cache_tokens_identical']}, largest state difference "
              f"{f['fused_cache_max_state_diff']}; {f['conversations']} conversations x <= {f['max_new_tokens']} "
              f"tokens, {res['threads']} threads", flush=True)
        if args.out:
            write_json(args.out, res)
        return res
    names = tuple(x for x in args.engines.split(",") if x)
    d = res["data_path"] = _data_path(target, pool[: args.data_prompts], args.data_new_tokens, args.hf_batch,
                                      args.rows, args.repeats, names, args.forward)
    res["cpu"], res["dtype"] = _cpu_name(), choice.name
    outs = d.pop("outputs")
    if args.vllm:
        vpath = Path(args.out or "runs/bench_pipeline").with_suffix(".vllm.json")
        v = d["vllm"] = _vllm_data(target, pool[: args.data_prompts], args.data_new_tokens, outs.get("batched"),
                                   vpath, torch.get_num_threads(), choice.name)
        if "tokens_per_s" in v:
            for k in names:
                d[f"{k}_over_vllm"] = d[f"{k}_tokens_per_s"] / v["tokens_per_s"]
            print(f"vLLM batched: {v['tokens_per_s']:.1f} response tok/s ({v['response_tokens']} tokens, "
                  f"{v['seconds']} s); identical to our batched engine: {v.get('identical_to_ours', '-')}/"
                  f"{len(outs.get('batched', {}))}; " + ", ".join(f"{k} {d[f'{k}_over_vllm']:.2f}x vLLM"
                                                                   for k in names), flush=True)
            if args.pairs > 1:
                _more_pairs(d, args, target, pool[: args.data_prompts], names, vpath, choice.name)
        else:
            print(f"vLLM: {v['skipped']}")
    print(f"CPU: {res['cpu']}; {choice.name}; " + ", ".join(f"{k} {d[f'{k}_tokens_per_s']:.1f} response tok/s"
                                                           for k in names), flush=True)
    if not set(("hf", "masked", "batched")) <= set(names):
        if args.out:
            write_json(args.out, res)
        return res
    print(f"data path:  continuous batching {d['batched_tokens_per_s']:.1f} response tok/s ({d['rows']} rows) vs "
          f"HF generate batches of {d['hf_batch']} {d['hf_tokens_per_s']:.1f} tok/s -> {d['ratio']:.2f}x "
          f"(goal >= 2.5x, 4x); {d['identical_responses']}/{d['responses']} responses identical; "
          f"{d['conversations']} conversations x <= {d['max_new_tokens']} tokens, {res['threads']} threads", flush=True)
    print(f"            the engine before per-row attention and shared-prefix prefill "
          f"{d['masked_tokens_per_s']:.1f} tok/s -> {d['ratio_masked']:.2f}x HF; the two together "
          f"{d['engine_gain']:.2f}x; {d['identical_responses_masked']}/{d['responses']} identical",
          flush=True)
    if args.only_data:
        if args.out:
            write_json(args.out, res)
        return res

    # 1. generation: single vs batched, alternating, same prompts
    single, batched = [], []
    for _ in range(args.repeats):
        single.append(_gen_tokens_per_s(target, prompts, args.new_tokens, batched=False))
        batched.append(_gen_tokens_per_s(target, prompts, args.new_tokens, batched=True))
    s_best, b_best = max(x[0] for x in single), max(x[0] for x in batched)
    outs = batched[-1][1]  # greedy: the same responses every run
    res["generation"] = {"single_tokens_per_s": s_best, "batched_tokens_per_s": b_best,
                         "batch_size": len(prompts), "ratio": b_best / s_best, "goal": ">= 3"}

    # 2. caching pass vs bare forward on the same sequences and batches
    seqs = []
    for q, (resp, fin) in zip(qs, outs):
        msgs = [{"role": "user", "content": q["turns"][0]},
                {"role": "assistant", "content": tok.decode(resp, skip_special_tokens=True)}]
        ids, mask = render_example(tok, msgs, [fin])
        seqs.append({"ids": ids, "mask": mask})
    ntok = sum(len(s["ids"]) for s in seqs)
    bare, cached = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            bare.append(_bare_forward(target, seqs, args.batch_tokens))
            t0 = time.perf_counter()
            idx = build_cache(target, seqs, ["final"], Path(tmp) / f"c{r}", dtype="float16",
                              batch_tokens=args.batch_tokens)
            cached.append(ntok / (time.perf_counter() - t0))
        res["caching"] = {"tokens": ntok, "bare_forward_tokens_per_s": max(bare), "cache_tokens_per_s": max(cached),
                          "ratio": max(cached) / max(bare), "bytes_per_token": idx["bytes_per_token"], "goal": ">= 0.9"}

        # 3. head training: share of wall time outside model math
        recipe = parse_recipe({"name": "bench", "output_dir": str(Path(tmp) / "run"),
                               "drafter": {"kind": "medusa", "num_heads": 4},
                               "train": {"max_steps": args.train_steps, "batch_size": 4, "chunk_len": 64,
                                         "tracker": "none", "save_every": 10_000, "log_every": 10}})
        _, timing = train(recipe, target, Path(tmp) / "c0", recipe.out, resume=False)
        res["training"] = {**{k: timing[k] for k in ("wall_s", "math_s", "data_s", "stats_s", "checkpoint_s",
                                                      "steps", "positions")},
                           "outside_math_share": timing["outside_math_share"], "goal": "<= 0.10"}

    g, c, t = res["generation"], res["caching"], res["training"]
    print(f"generation: batched {g['batched_tokens_per_s']:.1f} tok/s (batch {g['batch_size']}) vs single "
          f"{g['single_tokens_per_s']:.1f} tok/s -> {g['ratio']:.2f}x (goal >= 3x)")
    print(f"caching:    {c['cache_tokens_per_s']:.0f} tok/s vs bare forward {c['bare_forward_tokens_per_s']:.0f} tok/s "
          f"-> {c['ratio']:.2f}x (goal >= 0.9x); {c['bytes_per_token']:.0f} bytes/token on disk")
    print(f"training:   {100 * t['outside_math_share']:.1f}% of {t['wall_s']:.1f} s wall outside model math "
          f"(data {t['data_s']:.2f} s, stats {t['stats_s']:.2f} s, checkpoints {t['checkpoint_s']:.2f} s; goal <= 10%)")
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
