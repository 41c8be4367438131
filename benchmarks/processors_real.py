"""Penalties and logit bias on the real target: chi-square at T=0.8 and greedy equality, with and without a drafter.

Chi-square (eval/mc_lossless.py's cells, fixed from the processed target alone): the first ``--new-tokens``
tokens of ``--samples`` speculative samples of one chat prompt, with a frequency penalty, a repetition penalty
and a logit bias (on the tokens ranked 1st and 3rd by the target at the first position: -1.5 and +1.5, so the
bias changes the output), for plain decoding, the drafter's chain and the drafter with ``--tree``. Each sample
set is also tested against the UNPROCESSED target's cells (it must fail: the test has teeth).

Greedy equality: ``--prompts`` MT-Bench first turns, ``--max-new-tokens`` tokens, with the same processors
(no bias-by-rank here: a fixed bias on two token ids) for plain decoding, the chain, the tree and the batched
decoder (all prompts in one batch, chain and tree); divergences are counted with the processed top-2 gap.

    OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.processors_real \\
        --checkpoint runs/quickstart/final --out runs/processors_real.json
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import add_common_args, parser, setup, write_json
from draftsmith.chat import prompt_token_ids
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.processors import Penalties, RequestProcessing
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.tree_build import parse_tree
from draftsmith.eval.greedy_equality import first_divergence
from draftsmith.eval.mc_lossless import chi_square, mc_counts, target_cells


def main(argv: list[str] | None = None) -> dict:
    ap = parser("processors_real", __doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tree", default="built:4")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--frequency-penalty", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.3)
    ap.add_argument("--prompt", default="Write a story about a dragon.")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    add_common_args(ap, threads=True, threads_default=1, seed=True, out="file", out_required=False)
    b = setup(ap.parse_args(argv), out_file=True, layout=False)
    a, target = b.args, b.target
    drafter = drafter_from_checkpoint(a.checkpoint, target)
    tree = parse_tree(a.tree, a.checkpoint)
    report: dict = {"checkpoint": a.checkpoint, "tree": a.tree, "threads": a.threads}

    # ---------------------------------------------------------------- chi-square
    prompt = prompt_token_ids(target.tokenizer, [{"role": "user", "content": a.prompt}])
    with torch.no_grad():
        first = target.model(torch.tensor([prompt])).logits[0, -1]
    base = Penalties(frequency=a.frequency_penalty, repetition=a.repetition_penalty)
    ranked = torch.topk(RequestProcessing(base).logits_for(prompt, len(prompt), first), 3).indices.tolist()
    pen = Penalties(frequency=a.frequency_penalty, repetition=a.repetition_penalty,
                    logit_bias=((ranked[0], -1.5), (ranked[2], 1.5)))
    sampling = SamplingParams(a.temperature)
    proc = RequestProcessing(pen, target.vocab_size)
    cells = target_cells(target, prompt, a.new_tokens, a.samples, sampling, processing=proc)
    raw_cells = target_cells(target, prompt, a.new_tokens, a.samples, sampling)
    chi = {"prompt": a.prompt, "temperature": a.temperature, "new_tokens": a.new_tokens,
           "penalties": {"frequency": pen.frequency, "repetition": pen.repetition,
                         "logit_bias": {str(t): v for t, v in pen.logit_bias}}, "methods": {}}
    methods = {"plain": SpeculativeDecoder(target, None, sampling=sampling),
               "hydra-chain": SpeculativeDecoder(target, drafter, sampling=sampling),
               f"hydra-{a.tree}": SpeculativeDecoder(target, drafter, tree=tree, sampling=sampling)}
    for name, dec in methods.items():
        dec.processing = proc
        t0 = time.perf_counter()
        counts, drafted, accepted = mc_counts(dec, prompt, a.new_tokens, a.samples, a.seed)
        r = chi_square(counts, *cells)
        wrong = chi_square(counts, *raw_cells)
        r.update(drafted=drafted, accepted=accepted, sample_s=time.perf_counter() - t0,
                 p_value_vs_unprocessed_target=wrong["p_value"], **{"pass": r["p_value"] > 1e-3})
        chi["methods"][name] = r
        print(f"chi2 {name:16s} n={r['samples']} cells={r['cells']} p={r['p_value']:.4f} "
              f"(vs unprocessed target p={wrong['p_value']:.2e}) drafted={drafted} accepted={accepted}", flush=True)
    report["chi_square"] = chi

    # ---------------------------------------------------------------- greedy equality
    gpen = Penalties(frequency=0.5, presence=0.3, repetition=1.2, logit_bias=((ranked[0], -2.0), (ranked[2], 2.0)))
    prompts = [p.ids for p in b.prompts(a.prompts)]
    n = a.max_new_tokens

    def single(drafter_, tree_):
        outs = []
        for p in prompts:
            dec = SpeculativeDecoder(target, drafter_, tree=tree_)
            dec.processing = RequestProcessing(gpen)
            outs.append(dec.generate(p, n).tokens)
        return outs

    t0 = time.perf_counter()
    plain = single(None, None)
    unprocessed = [SpeculativeDecoder(target).generate(p, n).tokens for p in prompts]
    runs = {"hydra-chain": single(drafter, None), f"hydra-{a.tree}": single(drafter, tree)}
    for name, tr in [("batched-hydra-chain", None), (f"batched-hydra-{a.tree}", tree)]:
        bd = BatchedSpeculativeDecoder(target, drafter, tree=tr)
        runs[name] = [r.tokens for r in bd.generate(prompts, n, processing=[RequestProcessing(gpen)
                                                                           for _ in prompts]).rows]
    greedy = {"prompts": len(prompts), "max_new_tokens": n,
              "penalties": {"frequency": gpen.frequency, "presence": gpen.presence, "repetition": gpen.repetition,
                            "logit_bias": {str(t): v for t, v in gpen.logit_bias}},
              "plain_changed_by_processors": sum(x != y for x, y in zip(plain, unprocessed)), "methods": {}}
    for name, outs in runs.items():
        divs = []
        for p, x, y in zip(prompts, plain, outs):
            d = first_divergence(x, y)
            if d is not None:
                with torch.no_grad():
                    ctx = p + x[:d]
                    raw = target.model(torch.tensor([ctx])).logits[0, -1]
                    lg = RequestProcessing(gpen).logits_for(ctx, len(p), raw)
                top = torch.topk(lg.float(), 2).values
                divs.append({"at": d, "top2_gap": float(top[0] - top[1])})
        greedy["methods"][name] = {"equal": len(prompts) - len(divs), "divergences": divs}
        print(f"greedy {name:24s} equal {len(prompts) - len(divs)}/{len(prompts)} {divs}", flush=True)
    greedy["wall_s"] = time.perf_counter() - t0
    report["greedy"] = greedy
    if b.out:
        write_json(b.out, report)
    return report


if __name__ == "__main__":
    main()
