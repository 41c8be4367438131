"""Benchmark decoding methods on MT-Bench first turns, interleaved per prompt.

Methods (each a `Method`: a name and a ``run(prompt_ids, max_new_tokens, seed)``):
  * ours: plain decoding, and speculative decoding with any drafter / tree;
  * Hugging Face ``generate`` (plain) and assisted generation with a given
    assistant model, a constant number of assistant tokens and the
    confidence-threshold heuristic off, so its draft length matches ours.
For HF methods, target forwards are counted with a forward hook (every
call emits tokens, the prompt's included, as with ours), so tau is defined
identically for every method.

Every method is warmed up once, then for each prompt every method runs in
turn (interleaved, so machine noise hits all methods alike; the order is shuffled per prompt). Figures come
from engine/metrics.py; speedups always name their baseline.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.metrics import DecodeResult, speedup, summarize, tau
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.target import dtype_name

BASELINE = "plain (ours)"
PLAIN = ("plain (ours", "HF generate", "llama.cpp plain", "vLLM plain")  # how every plain decoding's method name starts


def is_plain(name: str) -> bool:
    """Whether a benchmark method is plain decoding (ours in any dtype, HF ``generate``, llama.cpp's)."""
    return name.startswith(PLAIN)


def mark_fastest_plain(figures: dict) -> str | None:
    """Name the fastest plain decoding among ``figures``' methods (`is_plain`) as ``figures["fastest_plain"]`` (every
    method's speedup against it is already there: `set_speedups`). Returns its name; None when no plain method ran."""
    ms = figures["methods"]
    plains = [n for n in ms if is_plain(n)]
    if not plains:
        return None
    fastest = max(plains, key=lambda n: ms[n]["tokens_per_s"])
    figures["fastest_plain"] = fastest
    return fastest


def add_plain(figures: dict, name: str, stats: dict) -> None:
    """Another engine's plain decoding, measured on the same prompts (llama.cpp's, vLLM's), as method ``name`` of
    ``figures`` (``stats``: at least ``tokens_per_s``); every method's speedups then name every plain decoding in
    ``figures``, and the fastest is marked (`mark_fastest_plain`)."""
    if not is_plain(name):
        raise ValueError(f"{name!r} is not named as a plain decoding (names start with one of {PLAIN})")
    figures["methods"][name] = {"tau": 1.0, "mean_draft_len": 0.0, "acceptance_by_position": [], "time_shares": None,
                                **stats}
    set_speedups(figures)
    mark_fastest_plain(figures)


def set_speedups(figures: dict) -> None:
    """Every method's ``speedup``: against every plain decoding in ``figures`` (ours first, then the others in
    method order), whichever is fastest, so a table lists the same baselines on every machine."""
    ms = figures["methods"]
    plains = sorted((n for n in ms if is_plain(n)), key=lambda n: n != BASELINE)
    for s in ms.values():
        s["speedup"] = [speedup(s["tokens_per_s"], ms[b]["tokens_per_s"], b) for b in plains]


@dataclass
class Method:
    name: str
    run: Callable[[list[int], int, int], DecodeResult]
    family: str = "ours"  # "ours" or "hf"
    after_warmup: Callable[[], None] | None = None  # forget what the warm-up runs taught (a learning index)


def ours(name: str, dec) -> Method:
    """A `SpeculativeDecoder` (plain when it has no drafter) as a benchmark method."""
    return Method(name, lambda ids, n, seed: dec.generate(ids, n, seed=seed), "ours")


def prepare_plain_target(other, forward: str, cpu_layout: bool = True) -> None:
    """Set up the target loaded in another dtype for `plain_in_dtype`: the CPU decoding layout and the forward
    decoding uses. Plain decoding compiles only the 1-row graph, whose products are the native kernels: no GEMM to
    autotune."""
    if cpu_layout:
        apply_cpu_layout(other)
    use_fast_forward(other, forward, autotune=False)


def plain_in_dtype(other, sampling: SamplingParams) -> Method:
    """Our plain decoding of the target loaded in another dtype, as method ``plain (ours, DTYPE)``."""
    return ours(f"{BASELINE[:-1]}, {dtype_name(other.dtype)})", SpeculativeDecoder(other, sampling=sampling))


class _ForwardCounter:
    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


def _hf_kwargs(target, sampling: SamplingParams) -> dict:
    kw = {"eos_token_id": list(target.eos_token_ids), "pad_token_id": target.tokenizer.pad_token_id}
    if sampling.greedy:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kw.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return kw


def hf_run(target, sampling: SamplingParams, extra: dict) -> Callable[[list[int], int, int], DecodeResult]:
    """A ``run(prompt_ids, max_new_tokens, seed)`` for a `Method` that decodes with Hugging Face ``generate``
    on ``target``: the target's EOS ids and ``sampling`` as generation settings, ``extra`` passed on to
    ``generate`` (e.g. ``assistant_model``); target forwards counted with a forward hook, tokens cut after EOS."""
    model = target.model
    dev = next(model.parameters()).device

    @torch.no_grad()
    def run(ids: list[int], n: int, seed: int) -> DecodeResult:
        torch.manual_seed(seed)
        counter = _ForwardCounter(model)
        try:
            t0 = time.perf_counter()
            out = model.generate(torch.tensor([ids], device=dev), max_new_tokens=n, **_hf_kwargs(target, sampling),
                                 **extra)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
        finally:
            counter.handle.remove()
        toks = out[0, len(ids):].tolist()
        eos = set(target.eos_token_ids)
        hit = next((i for i, t in enumerate(toks) if t in eos), None)
        toks = toks if hit is None else toks[: hit + 1]
        return DecodeResult(tokens=toks, prompt_len=len(ids), wall_s=wall, counted_forwards=counter.calls,
                            stop_reason="eos" if hit is not None else "max_new_tokens")

    return run


def hf_generate(target, sampling: SamplingParams) -> Method:
    """Hugging Face ``generate`` without a drafter."""
    return Method("HF generate", hf_run(target, sampling, {}), "hf")


def hf_assisted(target, assistant: torch.nn.Module, num_tokens: int, sampling: SamplingParams,
                name: str | None = None) -> Method:
    """Hugging Face assisted generation: constant ``num_tokens`` drafts, confidence threshold off."""
    asst = copy.copy(assistant)
    asst.generation_config = copy.deepcopy(assistant.generation_config)
    asst.generation_config.num_assistant_tokens = int(num_tokens)
    asst.generation_config.num_assistant_tokens_schedule = "constant"
    asst.generation_config.assistant_confidence_threshold = 0.0  # 0 = off: always draft num_tokens
    return Method(name or f"HF assisted K={num_tokens}", hf_run(target, sampling, {"assistant_model": asst}), "hf")


def compile_seconds(target, drafters=()) -> float:
    """Seconds spent so far compiling graphs: the target's compiled forward and ``drafters``' compiled drafting
    (the benchmarks take what a timed run spent compiling out of its time, and report it)."""
    fb = getattr(target, "fast_body", None)
    return float(getattr(fb, "compile_s", 0.0)) + sum(float(getattr(d, "compile_s", 0.0)) for d in drafters)


def run_bench(methods: list[Method], prompts: list, max_new_tokens: int, seed: int = 0, warmup_tokens: int = 8,
              log: Callable[[str], None] | None = print, compile_clock: Callable[[], float] | None = None) -> dict:
    """Run every method on every prompt (interleaved) and return all figures.

    ``compile_clock``: seconds spent compiling graphs so far (the target's compiled forward and compiled
    drafting). A graph first compiled inside a timed run (a row bucket or cache size the warm-up did not meet)
    has its compile seconds taken out of that run's wall time; they are reported per method in
    ``compile_in_timed_s``."""
    if not methods:
        raise ValueError("no methods to benchmark")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique: {names}")
    longest = max(prompts, key=lambda p: len(p.ids))
    for m in methods:  # one-time costs (cache allocation, kernels) out of the timings
        m.run(prompts[0].ids, min(warmup_tokens, max_new_tokens), seed)
        if len(longest.ids) > len(prompts[0].ids):  # a compiled forward compiles per cache capacity (<= 2 here)
            m.run(longest.ids, max_new_tokens, seed)
        if m.after_warmup is not None:  # the warm-up prompts are benchmark prompts: nothing learnt from them stays
            m.after_warmup()
    per: dict[str, list[DecodeResult]] = {m.name: [] for m in methods}
    compiled = {m.name: 0.0 for m in methods}
    for k, pr in enumerate(prompts):
        # a seeded shuffle per prompt: no method always runs right after the same one (a method that leaves
        # the allocator or the CPU caches in a worse state would otherwise bias one neighbour every time;
        # a plain rotation keeps the same neighbours)
        order = list(methods)
        random.Random(seed * 7919 + k).shuffle(order)
        for m in order:
            c0 = compile_clock() if compile_clock is not None else 0.0
            r = m.run(pr.ids, max_new_tokens, seed + k)
            late = compile_clock() - c0 if compile_clock is not None else 0.0
            if late > 0:
                r = dataclasses.replace(r, wall_s=r.wall_s - late)
                compiled[m.name] += late
            per[m.name].append(r)
        if log:
            log(f"[{k + 1}/{len(prompts)}] q{pr.question_id} ({pr.category}): " + ", ".join(
                f"{m.name} {len(per[m.name][-1].tokens)} tok {per[m.name][-1].wall_s:.2f}s" for m in methods))
    figures = bench_figures(methods, prompts, per, max_new_tokens)
    figures["compile_in_timed_s"] = {k: round(v, 1) for k, v in compiled.items()}
    return figures


def bench_figures(methods: list[Method], prompts: list, per: dict[str, list[DecodeResult]],
                  max_new_tokens: int) -> dict:
    """`run_bench`'s figures from every method's results ``per[name]``, one per prompt (prompt order)."""
    prompts = prompts[: min(len(v) for v in per.values())] if per else prompts
    figures = {"max_new_tokens": max_new_tokens, "prompts": len(prompts), "methods": {}}
    cats = sorted({p.category for p in prompts})
    for m in methods:
        rs = per[m.name]
        s = summarize(rs)
        s["family"] = m.family
        s["tau_by_category"] = {}
        for c in cats:
            sub = [r for r, p in zip(rs, prompts) if p.category == c]
            s["tau_by_category"][c] = tau(sum(len(r.tokens) for r in sub), sum(r.target_forwards for r in sub))
        if m.family != "ours":  # HF does not expose per-step acceptance
            s["acceptance_by_position"] = []
            s["time_shares"] = None
        figures["methods"][m.name] = s
    set_speedups(figures)
    figures["per_prompt"] = [
        {"question_id": p.question_id, "category": p.category,
         **{m.name: {"tokens": len(per[m.name][i].tokens), "wall_s": per[m.name][i].wall_s,
                     "tau": per[m.name][i].tau} for m in methods}}
        for i, p in enumerate(prompts)]
    return figures


def table(figures: dict) -> str:
    """A plain-text table of the headline figures."""
    rows = [("method", "tokens/s", "tau", "draft len", "speedup", "accept@1..3", "draft/verify")]
    for name, s in figures["methods"].items():
        sp = "; ".join(f"{x['speedup']:.2f}x vs {x['baseline']}" for x in s["speedup"]) or "-"
        acc = ",".join("-" if a is None else f"{a:.2f}" for a in s["acceptance_by_position"][:3]) or "-"
        ts = s.get("time_shares")
        share = f"{ts['draft']:.0%}/{ts['verify']:.0%}" if ts else "-"
        rows.append((name, f"{s['tokens_per_s']:.2f}", f"{s['tau']:.2f}", f"{s.get('mean_draft_len', 0.0):.2f}", sp,
                     acc, share))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def default_methods(target, sampling: SamplingParams, *, drafter_layers: int | None = 8, draft_len: int = 4,
                    hf: bool = True, hf_assisted_too: bool = True, heads=None, trees: list | None = None,
                    cpu_layout: bool = False) -> list[Method]:
    """The standard comparison set (see the module docstring). ``cpu_layout``: give the standalone
    drafter `draftsmith.engine.cpu_layout`'s layout (the caller does the target's and ``heads``')."""

    methods = [ours(BASELINE, SpeculativeDecoder(target, sampling=sampling))]
    if hf:
        methods.append(hf_generate(target, sampling))
    if drafter_layers:
        dr = first_layers_drafter(target, drafter_layers)
        if cpu_layout:
            apply_cpu_layout(target, dr)
        methods.append(ours(f"ours first-{drafter_layers}-layers K={draft_len}",
                            SpeculativeDecoder(target, dr, policy=FixedLength(draft_len), sampling=sampling)))
        if hf_assisted_too:
            methods.append(hf_assisted(target, dr.model, draft_len, sampling,
                                       name=f"HF assisted first-{drafter_layers}-layers K={draft_len}"))
    if heads is not None:
        for label, tree in (trees or [("chain", None)]):
            methods.append(ours(f"ours {heads.name} {label}", SpeculativeDecoder(target, heads, tree=tree,
                                                                                  sampling=sampling)))
    return methods
