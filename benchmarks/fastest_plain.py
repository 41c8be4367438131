"""Plain decoding on this machine: ours (compiled and not), Hugging Face ``generate``, vLLM on CPU and llama.cpp on
the target's GGUF files, and each drafter's speedup over the fastest of them.

    python -m benchmarks.fastest_plain [--prompts 80] [--long-prompts N] [--max-new-tokens 128] [--threads 2]
        [--dtype float32] [--checkpoint CKPT --tree built:best ...] [--vllm-modes compiled,eager] [--batched] --out FILE

One process of ours runs its methods interleaved per prompt (a seeded shuffle per prompt, as eval/bench.py):
  * ``plain (ours, compiled)``: our static-shape forward compiled with inductor (engine/fastpath.py);
  * ``--blas-linears``: the same with the BLAS products and masked attention (the native kernels off);
  * ``--extra-dtype D``: ours compiled in a second dtype too (and vLLM in it), e.g. bfloat16 beside float32;
  * ``plain (ours, eager)``: the model's own forward with the CPU weight layout (what the decoder used before);
  * ``HF generate``;
  * each ``--checkpoint`` with each ``--tree``, on the compiled forward.
Then vLLM (its own environment, .venv-vllm; scripts/vllm_env.sh) runs the same prompts, one request at a time,
once per ``--vllm-modes`` entry (compiled = vLLM's default CPU compile mode, eager = enforce_eager), right after,
with the same thread count. ``--batched``: also every prompt at once, vLLM against our batched decoder.
llama.cpp (``scripts/llamacpp_env.sh`` builds it) runs through ``llama-server``, one request at a time, on the
target's GGUF of each ``--llamacpp`` type (shipped: the file the target ships as, Q4_1 for the default target;
the 4-bit file is not the fp32 model's arithmetic, so its greedy tokens may differ from ours at near-ties and
beyond): one server per file, all started before the warm-up, each a method interleaved per prompt with ours
(an idle server takes about 1% of a core); ``--llamacpp-after``: one file after another once ours are done, as
before 2026-12-07. ``--pages-ab``: each of our compiled lines also with its weights on 4 KiB pages
(``DRAFTSMITH_HUGEPAGES=0`` for a second copy of the target), side by side with the default 2 MiB pages.

Printed: tok/s of each method; greedy outputs equal to ours compiled (count, with the top-2 logit gap at each
first divergence); per-token step time against the memory floor (the bytes of the weights one forward reads,
divided by this machine's measured read bandwidth); each drafter's speedup over the fastest plain decoding
measured, named. Compile time is reported and counted in nothing else (warm-up runs absorb it).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import time
from pathlib import Path

import torch

from draftsmith.checkpoint import command_line, drafter_from_checkpoint, environment
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import FastBody
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.bench import hf_generate, ours
from draftsmith.eval.greedy_equality import first_divergence, top2_gap
from draftsmith.eval.humaneval import long_prompt_ids
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.engine.tree_build import parse_tree
from draftsmith.export.llamacpp import have_llamacpp, target_gguf
from draftsmith.export.llamacpp_server import LlamaServer, llamacpp_plain_methods, run_prompts, shipped_type
from draftsmith.export.vllm_check import run_vllm, vllm_python
from draftsmith.target import cpu_name, load_target, resolve_dtype


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second this machine reads a large fp32 tensor at (a sum over 1 GiB, best of ``repeats``)."""
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2 ** 20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


GAPS = 20  # divergences whose top-2 gap is measured, per method


def forward_bytes(model) -> int:
    """Bytes of weights one decoding forward reads: every matrix (the LM head included, tied or not), one
    embedding row left out."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    if head is not emb and head.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()  # the input embedding: one row read per token
    return total


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--long-prompts", type=int, default=0, metavar="N",
                    help="prompts of at least N tokens (HumanEval's stubs one after another, eval/humaneval.py "
                         "long_prompt_ids) instead of MT-Bench first turns: decoding deep in a context, past a "
                         "sliding window (Gemma 3's 512) where a target has one")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    ap.add_argument("--extra-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="also ours and vLLM in this dtype, side by side in the same run (e.g. bfloat16 on a CPU "
                         "with native bf16, beside float32's packed weights)")
    ap.add_argument("--checkpoint", action="append", default=[])
    ap.add_argument("--tree", action="append", default=None, help="trees for the checkpoints (default: chain)")
    ap.add_argument("--vllm-modes", default="compiled,eager", help="comma list of compiled, eager; '' = no vLLM")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--llamacpp", default="shipped,bf16,f32",
                    help="llama.cpp plain decoding on the target's GGUF of these types (shipped: the file the target "
                         "ships as, Q4_1 for the default; others converted from the target's directory), "
                         "through llama-server; '' = none (left out with the reason when there is no build)")
    ap.add_argument("--llamacpp-after", action="store_true",
                    help="llama.cpp after ours, one file after another (default: interleaved per prompt with ours)")
    ap.add_argument("--pages-ab", action="store_true",
                    help="also each of our compiled lines with its weights on 4 KiB pages, side by side")
    ap.add_argument("--no-eager", action="store_true", help="leave out ours on the model's own forward")
    ap.add_argument("--no-hf", action="store_true", help="leave out Hugging Face generate")
    ap.add_argument("--blas-linears", action="store_true",
                    help="also ours compiled with the BLAS products and the masked attention in every step (the "
                         "native rows_linear and decode kernels off), side by side with the default")
    ap.add_argument("--float32-weights", action="store_true",
                    help="also ours compiled with every weight read as float32 (not from the exact 4/8-bit copies "
                         "of a target dequantised from a GGUF file), side by side with the default")
    ap.add_argument("--batched", action="store_true", help="also all prompts at once: vLLM and our batched decoder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    choice = resolve_dtype(a.dtype, "cpu")
    target = load_target(a.target, dtype=choice.dtype)
    if a.long_prompts:
        ids = long_prompt_ids(target.tokenizer, a.prompts, a.long_prompts)
    else:
        ids = [p.ids for p in mtbench_prompts(target.tokenizer, a.prompts, spread=True)]
    report = {"cpu": cpu_name(), "threads": a.threads, "dtype": choice.name, "dtype_reason": choice.reason,
              "prompts": len(ids), "max_new_tokens": a.max_new_tokens, "methods": {},
              "prompt_set": f"long (>= {a.long_prompts} tokens)" if a.long_prompts else "mt-bench first turns",
              "prompt_tokens": [len(x) for x in ids], "command": command_line(), "environment": environment()}
    print(f"CPU: {report['cpu']}; {a.threads} threads; {choice.name}; {len(ids)} prompts x {a.max_new_tokens}; "
          f"{report['prompt_set']}, {min(report['prompt_tokens'])}-{max(report['prompt_tokens'])} prompt tokens")

    drafters = [(Path(c), drafter_from_checkpoint(c, target)) for c in a.checkpoint]
    apply_cpu_layout(target, *[d for _, d in drafters])  # the eager methods' best layout
    fast = FastBody(target.model, compile=True)
    methods: dict[str, SpeculativeDecoder] = {}
    target.fast_body = fast
    methods["plain (ours, compiled)"] = SpeculativeDecoder(target)
    if a.float32_weights:
        target.fast_body = FastBody(target.model, compile=True, pack=False)
        methods["plain (ours, compiled, float32 weights)"] = SpeculativeDecoder(target)
        target.fast_body = fast
    if a.blas_linears:
        blas = FastBody(target.model, compile=True)
        blas.core.rows_native, blas.core.attend_one = False, None  # before the first call traces the graphs
        blas.core.attend_block, blas.core.packed = None, torch.nn.ModuleDict()
        target.fast_body = blas
        methods["plain (ours, compiled, BLAS linears)"] = SpeculativeDecoder(target)
        target.fast_body = fast
    for path, d in drafters:
        # the run's name (runs/NAME/final): two checkpoints of one kind must not share a label (a dict key)
        run_name = path.parent.name if path.name == "final" else path.name
        for spec in a.tree or ["chain"]:
            label = f"{d.name or 'drafter'} {run_name} {spec} (ours, compiled)"
            if label in methods:
                raise SystemExit(f"two checkpoints would both be labelled {label!r}: give them distinct run names")
            methods[label] = SpeculativeDecoder(target, d, tree=parse_tree(spec, path))
    target.fast_body = None
    extra = None
    if a.extra_dtype and a.extra_dtype != choice.name:  # ours in a second dtype, interleaved with the rest
        extra = load_target(a.target, dtype=resolve_dtype(a.extra_dtype, "cpu").dtype)
        extra.fast_body = FastBody(extra.model, compile=True)
        methods[f"plain (ours, compiled, {a.extra_dtype})"] = SpeculativeDecoder(extra)
        extra.fast_body = None
    if a.pages_ab:  # the same lines on a second copy of the target whose weights stay on 4 KiB pages
        lines = [("plain (ours, compiled", choice.dtype, True, True)]  # label, dtype, packed, CPU layout (as above)
        if a.float32_weights:
            lines.append(("plain (ours, compiled, float32 weights", choice.dtype, False, True))
        if extra is not None:
            lines.append((f"plain (ours, compiled, {a.extra_dtype}", extra.dtype, True, False))
        for label, dt, pack, layout in lines:
            methods[f"{label}, 4 KiB pages)"] = _on_small_pages(a.target, dt, pack, layout)
    if not a.no_eager:
        methods["plain (ours, eager)"] = SpeculativeDecoder(target)
    run = {name: ours(name, dec).run for name, dec in methods.items()}
    if not a.no_hf:
        run["HF generate"] = hf_generate(target, SamplingParams()).run
    servers = contextlib.ExitStack()
    atexit.register(servers.close)  # the servers stop however this run ends
    ll_types = [t for t in a.llamacpp.split(",") if t]
    ll_why = have_llamacpp() if ll_types else None
    ll: dict = {}
    if ll_types and not ll_why and not a.llamacpp_after:  # llama.cpp's files, interleaved with ours
        for m in llamacpp_plain_methods(servers, ll, target, ll_types, threads=a.threads, logs=Path(a.out)):
            run[m.name] = m.run
        if ll.get("llamacpp"):
            print(f"llama.cpp: {ll['llamacpp']}")
    t0 = time.perf_counter()
    longest = max(ids, key=len)
    for name, f in run.items():  # warm-up: compiles every graph these methods use (timed apart), the longest
        f(ids[0], 8, a.seed)     # prompt's cache capacity included
        f(longest, a.max_new_tokens, a.seed)
    report["warmup_s"] = round(time.perf_counter() - t0, 1)
    report["compile_s"] = round(fast.compile_s, 1)
    if extra is not None:
        report["compile_s_extra_dtype"] = round(methods[f"plain (ours, compiled, {a.extra_dtype})"].fast.compile_s, 1)
    print(f"warm-up {report['warmup_s']} s, of which compiling {report['compile_s']} s")
    outs = {n: [] for n in run}
    walls = {n: 0.0 for n in run}
    forwards = {n: 0 for n in run}
    for k, p in enumerate(ids):
        order = list(run)
        random.Random(a.seed * 7919 + k).shuffle(order)
        for n in order:
            r = run[n](p, a.max_new_tokens, a.seed + k)
            outs[n].append(list(r.tokens))
            walls[n] += r.wall_s
            forwards[n] += r.target_forwards
        if (k + 1) % 10 == 0 or k + 1 == len(ids):
            print(f"[{k + 1}/{len(ids)}] " + ", ".join(f"{n} {sum(map(len, outs[n])) / walls[n]:.2f}" for n in run),
                  flush=True)
    servers.close()
    ref = outs["plain (ours, compiled)"]

    def agree(other: list[list[int]]) -> dict:
        """Equal outputs, and each divergence's position; the top-2 gap (a cache-free forward of the model's own,
        slow in bf16 on a CPU without bf16 instructions) for the first `GAPS` divergences only."""
        div = []
        for p, x, y in zip(ids, ref, other):
            i = first_divergence(x, y)
            if i is not None:
                gap = round(top2_gap(target, p + x[:i]), 5) if len(div) < GAPS else None
                div.append({"position": i, "top2_gap": gap})
        return {"equal": len(ids) - len(div), "of": len(ids), "divergences": div}

    for n in run:
        toks = sum(map(len, outs[n]))
        report["methods"][n] = {"tokens": toks, "wall_s": round(walls[n], 2), "tok_s": round(toks / walls[n], 3),
                                "tau": round(toks / max(forwards[n], 1), 3), "equal_to_ours_compiled": agree(outs[n])}
    if fast.packed:
        report["packed"] = fast.packed
    for name, dec in methods.items():  # a compiled line's floor: the bytes its step reads (packed where it is)
        if getattr(dec, "fast", None) is not None:
            report["methods"][name]["weight_bytes"] = dec.fast.step_bytes()
    for name, gguf in ll.get("llamacpp_files", {}).items():
        report["methods"][name]["weight_bytes"] = Path(gguf).stat().st_size
    report["llamacpp_order"] = "after ours" if a.llamacpp_after else "interleaved per prompt with ours"
    report["pages"] = {n: dec.fast.core.pages for n, dec in methods.items() if getattr(dec, "fast", None)}

    def save() -> None:
        """The report so far: an engine that fails later loses nothing measured before it."""
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))

    save()
    Path(a.out).with_suffix(".tokens.json").write_text(json.dumps({"prompts": ids, "outputs": outs}))
    report["failed"] = {}

    def engine_failed(name: str, e: Exception) -> None:
        print(f"{name}: FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); left out, the "
              f"rest goes on", flush=True)
        report["failed"][name] = f"{type(e).__name__}: {e}"
        save()

    py = vllm_python(a.vllm_python)
    modes = [m for m in a.vllm_modes.split(",") if m]
    if modes and py is None:
        print("vLLM: no .venv-vllm (bash scripts/vllm_env.sh builds it): left out")
        report["vllm"] = "not built"
    vllm_dtypes = [choice.name] + ([a.extra_dtype] if extra is not None else [])
    for mode, dt in [(m, d) for m in modes for d in vllm_dtypes] if py else []:
        tag = mode if dt == choice.name else f"{mode}, {dt}"
        out = Path(a.out).with_suffix(f".vllm-{mode}{'' if dt == choice.name else '-' + dt}.json")
        name = f"vLLM plain ({tag})"
        try:
            res = run_vllm(py, str(target.path), ids, a.max_new_tokens, out, threads=a.threads,
                           extra={"enforce_eager": mode == "eager", "dtype": dt})
        except Exception as e:  # noqa: BLE001 (one engine's failure is recorded; the others still run)
            engine_failed(name, e)
            continue
        report["methods"][name] = {"tokens": res["generated"], "wall_s": round(res["wall_s"], 2),
                                   "tok_s": round(res["generated"] / res["wall_s"], 3),
                                   "equal_to_ours_compiled": agree(res["tokens"])}
        print(f"{name}: {report['methods'][name]['tok_s']:.2f} tok/s", flush=True)
        save()
        if a.batched:
            res = run_vllm(py, str(target.path), ids, a.max_new_tokens, out.with_suffix(".batched.json"),
                           threads=a.threads, extra={"enforce_eager": mode == "eager", "dtype": dt,
                                                     "batched": True})
            report["methods"][f"vLLM batched ({tag})"] = {
                "tokens": res["generated"], "wall_s": round(res["wall_s"], 2),
                "tok_s": round(res["generated"] / res["wall_s"], 3)}
    why = ll_why
    if why:
        print(f"llama.cpp: left out ({why.splitlines()[0]})")
        report["llamacpp"] = why
    for t in ll_types if not why and a.llamacpp_after else []:
        name = f"llama.cpp plain ({t})" if t != "shipped" else f"llama.cpp plain (shipped {shipped_type(target)})"
        try:
            gguf = target_gguf(target, t)
            with LlamaServer(gguf, threads=a.threads, log=Path(a.out).with_suffix(f".llamacpp-{t}.log")) \
                    as server:
                res = run_prompts(server, ids, a.max_new_tokens)
        except Exception as e:  # noqa: BLE001 (one engine's failure is recorded; the others still run)
            engine_failed(name, e)
            continue
        report["methods"][name] = {"tokens": res["generated"], "wall_s": round(res["wall_s"], 2),
                                   "tok_s": round(res["tok_s"], 3), "equal_to_ours_compiled": agree(res["tokens"]),
                                   "weight_bytes": gguf.stat().st_size}
        print(f"{name}: {res['tok_s']:.2f} tok/s", flush=True)
        save()
    if a.batched:
        from draftsmith.engine.batched import BatchedSpeculativeDecoder
        bd = BatchedSpeculativeDecoder(target)
        bd.generate(ids[:2], 4)
        t0 = time.perf_counter()
        res = bd.generate(ids, a.max_new_tokens)
        wall = time.perf_counter() - t0
        toks = res.tokens
        report["methods"]["batched (ours, eager)"] = {"tokens": toks, "wall_s": round(wall, 2),
                                                      "tok_s": round(toks / wall, 3)}

    plain = {n: m for n, m in report["methods"].items()
             if (n.startswith(("plain", "HF generate", "vLLM plain", "llama.cpp plain")))}
    fastest = max(plain, key=lambda n: plain[n]["tok_s"])
    report["fastest_plain"] = fastest
    for n, m in report["methods"].items():
        if "batched" not in n:
            m["x_fastest_plain"] = round(m["tok_s"] / plain[fastest]["tok_s"], 3)
    bw = read_bandwidth(a.threads)
    nbytes = forward_bytes(target.model)
    floor_ms = nbytes / bw * 1e3
    report["memory_floor"] = {"weight_bytes_per_forward": nbytes, "read_GBps": round(bw / 1e9, 2),
                              "floor_ms_per_forward": round(floor_ms, 2)}
    for n, m in report["methods"].items():
        if n.startswith(("plain", "vLLM plain", "llama.cpp plain")) or n == "HF generate":
            m["ms_per_token"] = round(1e3 / m["tok_s"], 2)
            # a GGUF's floor is its own file's bytes (the whole file, an upper bound on what a forward reads);
            # ours, packed: the bytes its step reads
            floor = m["weight_bytes"] / bw * 1e3 if "weight_bytes" in m else floor_ms
            m["x_memory_floor"] = round(1e3 / m["tok_s"] / floor, 2)
    save()
    print(f"\nmemory floor: {nbytes / 1e6:.0f} MB of weights per forward at {bw / 1e9:.1f} GB/s read = "
          f"{floor_ms:.1f} ms per token")
    print(f"fastest plain decoding here: {fastest}")
    print("| method | tok/s | x fastest plain | tau | ms/token (x floor) | greedy = ours compiled |")
    print("|---|---|---|---|---|---|")
    for n, m in report["methods"].items():
        eq = m.get("equal_to_ours_compiled")
        same = "-"
        if eq:
            same = f"{eq['equal']}/{eq['of']}"
            if eq["divergences"]:
                same += " (top-2 gaps " + ", ".join(str(d["top2_gap"]) for d in eq["divergences"][:5]) + ")"
        print(f"| {n} | {m['tok_s']:.2f} | {m.get('x_fastest_plain', '-')} | {m.get('tau', '-')} | "
              f"{m.get('ms_per_token', '-')} ({m.get('x_memory_floor', '-')}) | {same} |")
    for n, why in report["failed"].items():
        print(f"| {n} | failed: {why.splitlines()[0][:120]} | | | | |")
    return report


def _on_small_pages(name: str, dtype: torch.dtype, pack: bool, layout: bool) -> SpeculativeDecoder:
    """Our compiled plain decoding on another copy of the target, its weights left on 4 KiB pages; ``layout``: the
    CPU layout of the eager methods first, as the line it twins had."""
    before = os.environ.get("DRAFTSMITH_HUGEPAGES")
    os.environ["DRAFTSMITH_HUGEPAGES"] = "0"
    try:
        other = load_target(name, dtype=dtype)
        if layout:
            apply_cpu_layout(other)
        other.fast_body = FastBody(other.model, compile=True, pack=pack)
    finally:
        if before is None:
            os.environ.pop("DRAFTSMITH_HUGEPAGES")
        else:
            os.environ["DRAFTSMITH_HUGEPAGES"] = before
    dec = SpeculativeDecoder(other)
    other.fast_body = None
    return dec


if __name__ == "__main__":
    main()
