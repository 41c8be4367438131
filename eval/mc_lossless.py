"""Monte Carlo losslessness check on a real target: chi-square of sampled outputs vs the target's probabilities.

Speculative samples of the first ``n_new`` tokens are compared with
probabilities computed directly from the target (cache-free forwards). Cells
are fixed before sampling, from the target alone: every output with an
expected count >= ``min_expected`` is its own cell; the rest of each prefix
is pooled into a "prefix, anything else" cell when that pool is large
enough, and everything smaller goes to one "rest" cell. A p-value above
0.001 passes.

Script (the full run, >= 2000 samples per method; minutes on a CPU):
    python -m draftsmith.eval.mc_lossless --samples 2000 --out mc.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from draftsmith.chat import prompt_token_ids
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.drafters.suffix import PromptLookupDrafter, SuffixDrafter
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import add_forward_arg, use_fast_forward
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.heads.decode import HeadDrafter
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.tree_build import parse_tree
from draftsmith.engine.trees import DynamicTree
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.target import load_target

REST = ("rest",)
OTHER = "*"


@torch.no_grad()
def mc_counts(dec, prompt: list[int], n_new: int, n_samples: int, seed: int = 0) -> tuple[Counter, int, int]:
    """Sample ``n_samples`` outputs; the prompt is prefilled once and each sample starts from a clone.
    Returns (output counts, draft tokens drafted, draft tokens accepted): a run that drafted nothing proves nothing."""
    rng = TorchRandom(seed)
    base = dec.start(prompt, n_new)
    dec.prefill(base)  # once, instead of inside every sample's first forward
    counts: Counter = Counter()
    drafted = accepted = 0
    for _ in range(n_samples):
        st = base.clone()
        while not st.done:
            s = dec.step(st, rng)
            drafted, accepted = drafted + s.drafted, accepted + s.accepted
        counts[tuple(st.tokens[st.prompt_len:])] += 1
    return counts, drafted, accepted


@torch.no_grad()
def target_cells(target, prompt: list[int], n_new: int, n_samples: int, sampling: SamplingParams,
                 min_expected: float = 5.0, processing=None) -> tuple[dict, set, tuple]:
    """Data-independent cells with their exact probabilities, the prefixes split further, and the key
    that collects outputs falling in no cell (REST, or the cell REST was merged into when too small).
    ``processing`` (a `processors.RequestProcessing`): the target's logits are processed on the whole context."""
    eos = set(target.eos_token_ids)
    dev = next(target.model.parameters()).device
    cells: dict[tuple, float] = {}
    continued: set[tuple] = set()
    frontier = [((), 1.0)]
    rest = 0.0
    for _ in range(n_new):
        nxt = []
        live = [(p, w) for p, w in frontier if not (p and p[-1] in eos)]
        for p, w in frontier:
            if p and p[-1] in eos:
                cells[p] = w
        if live:
            ids = torch.tensor([prompt + list(p) for p, _ in live], device=dev)
            logits = target.model(ids).logits[:, -1]
            if processing is not None:
                logits = torch.stack([processing.logits_for(prompt + list(p), len(prompt), row)
                                      for (p, _), row in zip(live, logits)])
            probs = sampling.probs(logits).double()
            probs = probs / probs.sum(-1, keepdim=True)
            for (p, w), row in zip(live, probs):
                big = torch.nonzero(row * w * n_samples >= min_expected).flatten().tolist()
                kept = 0.0
                for t in big:
                    nxt.append((p + (t,), w * float(row[t])))
                    continued.add(p + (t,))
                    kept += float(row[t])
                other = w * max(0.0, 1.0 - kept)
                if other * n_samples >= min_expected:
                    cells[p + (OTHER,)] = other
                else:
                    rest += other
        frontier = nxt
    for p, w in frontier:
        cells[p] = w
    if rest * n_samples >= min_expected or not cells:
        cells[REST] = rest
        return cells, continued, REST
    # too small to stand alone: merge into the smallest cell (still fixed before sampling)
    k = min(cells, key=cells.get)
    cells[k] += rest
    return cells, continued, k


def assign(output: tuple, cells: dict, continued: set) -> tuple:
    """The cell an output falls into."""
    prefix: tuple = ()
    for t in output:
        if prefix + (t,) in continued:
            prefix = prefix + (t,)
            continue
        key = prefix + (OTHER,)
        return key if key in cells else REST
    return prefix if prefix in cells else REST


def chi_square(counts: Counter, cells: dict, continued: set, rest_key: tuple = REST) -> dict:
    """Pearson chi-square of observed cell counts against the exact cell probabilities."""
    from scipy.stats import chisquare

    n = sum(counts.values())
    obs: Counter = Counter()
    for out, c in counts.items():
        k = assign(out, cells, continued)
        obs[rest_key if k == REST else k] += c
    keys = [k for k in cells if cells[k] > 0.0]
    f_obs = [obs.get(k, 0) for k in keys]
    total_p = sum(cells[k] for k in keys)
    f_exp = [n * cells[k] / total_p for k in keys]
    stat, p = chisquare(f_obs, f_exp)
    return {"samples": n, "cells": len(keys), "statistic": float(stat), "p_value": float(p),
            "min_expected": min(f_exp), "unassigned": n - sum(f_obs)}


def mc_lossless(dec, prompt: list[int], n_new: int, n_samples: int, seed: int = 0) -> dict:
    """Sample with ``dec`` and test against the target: returns the chi-square figures."""
    cells, continued, rest_key = target_cells(dec.target, prompt, n_new, n_samples, dec.sampling,
                                              processing=getattr(dec, "processing", None))
    t0 = time.perf_counter()
    counts, drafted, accepted = mc_counts(dec, prompt, n_new, n_samples, seed)
    out = chi_square(counts, cells, continued, rest_key)
    out["drafted"], out["accepted"] = drafted, accepted
    out["sample_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> dict:

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--prompt", default="Write a story.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", action="append", default=[],
                    help="also test a trained drafter checkpoint (its chain; repeatable), e.g. Kangaroo or "
                         "pruned heads")
    ap.add_argument("--tree", action="append", default=[],
                    help="also test each checkpoint's drafter with this tree (as for `eval --tree`); repeatable")
    ap.add_argument("--only-checkpoints", action="store_true", help="skip the built-in random drafters")
    ap.add_argument("--trees-only", action="store_true", help="test the checkpoints with their --tree specs only")
    ap.add_argument("--suffix", type=int, default=0, metavar="N",
                    help="also SuffixDecoding, its global index holding N of the target's own sampled answers to "
                         "the prompt (32 tokens each), and prompt lookup")
    add_forward_arg(ap)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"), default="float32",
                    help="the target's dtype: the reference distribution is the target's in it (docs/methods.md)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    target = load_target(a.target, dtype=a.dtype)
    print(f"target forward: {use_fast_forward(target, a.forward)}")
    prompt = prompt_token_ids(target.tokenizer, [{"role": "user", "content": a.prompt}])
    sampling = SamplingParams(a.temperature, a.top_k, a.top_p)
    torch.manual_seed(a.seed)
    heads = MedusaHeads.for_target(target, num_heads=3)
    for blk in heads.blocks:  # random, non-identity heads: a poor but valid drafter
        torch.nn.init.normal_(blk[0].linear.weight, std=0.02)
    medusa = HeadDrafter(heads.to(target.dtype).eval(), target.fingerprint)
    methods = {
        "chain-first4-K3": SpeculativeDecoder(target, first_layers_drafter(target, 4), policy=FixedLength(3),
                                              sampling=sampling),
        "medusa-static-tree": SpeculativeDecoder(target, medusa, tree=[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)],
                                                 sampling=sampling),
        "medusa-dynamic-tree": SpeculativeDecoder(target, medusa, tree=DynamicTree(8, 3, 3), sampling=sampling),
    }
    if a.only_checkpoints:
        methods = {}
    for ck in a.checkpoint:
        d = drafter_from_checkpoint(ck, target)
        if not a.trees_only:
            methods[f"checkpoint:{ck}"] = SpeculativeDecoder(target, d, sampling=sampling)
        if capabilities(d).default_policy is not None and not a.trees_only:  # a confidence stop (Kangaroo)
            # may rarely draft at T > 0: also a fixed length
            methods[f"checkpoint:{ck} K=3"] = SpeculativeDecoder(target, d, policy=FixedLength(3), sampling=sampling)
        for spec in a.tree:
            methods[f"checkpoint:{ck} {spec}"] = SpeculativeDecoder(target, d, tree=parse_tree(spec, ck),
                                                                    sampling=sampling)
    if a.suffix:
        sd = SuffixDrafter()
        plain = SpeculativeDecoder(target, sampling=sampling)
        for i in range(a.suffix):  # the target's own answers: drafts that are often, not always, accepted
            sd.index.add_response(plain.generate(prompt, 32, seed=10_000 + i).tokens)
        methods[f"suffix ({a.suffix} answers indexed)"] = SpeculativeDecoder(target, sd, sampling=sampling)
        methods["prompt-lookup K=10"] = SpeculativeDecoder(target, PromptLookupDrafter(), sampling=sampling)
    report = {"prompt": a.prompt, "new_tokens": a.new_tokens, "sampling": vars(sampling), "methods": {}}
    for name, dec in methods.items():
        r = mc_lossless(dec, prompt, a.new_tokens, a.samples, a.seed)
        r["pass"] = r["p_value"] > 1e-3
        report["methods"][name] = r
        print(f"{name:22s} samples={r['samples']} cells={r['cells']} chi2={r['statistic']:.1f} "
              f"p={r['p_value']:.4f} {'PASS' if r['pass'] else 'FAIL'} ({r['sample_s']:.0f} s; "
              f"{r['drafted']} tokens drafted, {r['accepted']} accepted)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
