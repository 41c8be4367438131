"""Model-free drafting from traffic on three workloads, every method interleaved per prompt.

Workloads (``--workload``):
  * ``humaneval``: ``--samples`` samples of each of ``--problems`` HumanEval problems, served in turn (the
    samples of one problem one after the other), so the global index holds the earlier samples;
  * ``second``: MT-Bench second turns after the target's own first answers (greedy, ``--first-tokens``
    tokens, generated once and cached in OUT/../first_answers.json);
  * ``first``: MT-Bench first turns.
Methods: plain (ours), HF generate, HF prompt lookup, ours prompt lookup, ours SuffixDecoding, the trained
drafter (``--checkpoint``, ``--tree``) and the hybrid of it with SuffixDecoding. Each method with a global
index learns from its own finished responses in serving order (its warm-up run is forgotten).

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.suffix_bench --workload humaneval --problems 10 \\
        --samples 8 --temperature 0 0.8 --checkpoint runs/quickstart/final --out runs/suffix/humaneval

``--dtype`` and ``--forward`` (default float32 and the model's own forward, as the first runs) set the target's
dtype (HF's methods too) and our decoders' forward (HF's run the model's own): ``--dtype auto
--forward compile`` is the fastest plain decoding draftsmith has on a CPU with bf16.

Compiling (``--forward compile``): a graph first compiled inside a timed run is a one-time cost of whichever
method met that shape first; its seconds are taken out of that run's time and reported per method
(``compile_s_taken_out``).

Writes OUT/report.json after every prompt ("complete": false until the end; figures per temperature,
lookup time per step, index memory) and OUT/traffic.json
(prompt and response ids of plain decoding per temperature, for `benchmarks.suffix_replay`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.common import (add_common_args, compile_seconds, humaneval_messages, parser, provenance, setup,
                               write_json)
from draftsmith.checkpoint import drafter_from_checkpoint, read_manifest
from draftsmith.drafters.suffix import SuffixConfig
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import add_forward_arg, use_fast_forward
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.tree_build import parse_tree
from draftsmith.eval.bench import BASELINE, bench_figures, hf_generate, ours, table
from draftsmith.eval.mtbench import Prompt, mtbench_prompts
from draftsmith.eval.suffix import suffix_methods, suffix_stats
from draftsmith.paths import mtbench_questions_path
from draftsmith.traffic import chat_prompt_ids


def humaneval_prompts(tok, problems: int, samples: int) -> list[Prompt]:
    out = []
    for i, (task, msgs) in enumerate(humaneval_messages(0)[:problems]):
        ids = chat_prompt_ids(tok, msgs)
        out += [Prompt(i * samples + j, task, msgs[0]["content"], ids) for j in range(samples)]
    return out


def second_turn_prompts(target, n: int, first_tokens: int, cache: Path) -> list[Prompt]:
    """Second turns after the target's own greedy first answers (generated once, cached in ``cache``)."""
    tok = target.tokenizer
    rows = {int(r["question_id"]): r for r in map(json.loads, mtbench_questions_path().read_text().splitlines())
            if r.get("turns")}
    firsts = mtbench_prompts(tok, n, spread=True)
    have = json.loads(cache.read_text()) if cache.exists() else {}
    key = lambda p: f"{p.question_id}:{first_tokens}"  # noqa: E731
    missing = [p for p in firsts if key(p) not in have]
    if missing:
        dec = SpeculativeDecoder(target)
        for k, p in enumerate(missing):
            have[key(p)] = dec.generate(p.ids, first_tokens).tokens
            print(f"first answer {k + 1}/{len(missing)}: q{p.question_id}", flush=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(have))
    eos = set(target.eos_token_ids)
    out = []
    for p in firsts:
        ans = [t for t in have[key(p)] if t not in eos]
        t1, t2 = rows[p.question_id]["turns"][:2]
        msgs = [{"role": "user", "content": t1}, {"role": "assistant", "content": tok.decode(ans)},
                {"role": "user", "content": t2}]
        out.append(Prompt(p.question_id, p.category, t2, chat_prompt_ids(tok, msgs)))
    return out


def main(argv=None) -> dict:
    ap = parser("suffix_bench", __doc__)
    ap.add_argument("--workload", choices=["humaneval", "second", "first"], required=True)
    ap.add_argument("--problems", type=int, default=10, help="humaneval: problems (seeded order)")
    ap.add_argument("--samples", type=int, default=8, help="humaneval: samples per problem, served in turn")
    ap.add_argument("--prompts", type=int, default=20, help="MT-Bench workloads: questions, spread over categories")
    ap.add_argument("--first-tokens", type=int, default=128, help="second: length of the cached first answers")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--checkpoint", default=None, help="the trained drafter (and its hybrid with SuffixDecoding)")
    ap.add_argument("--tree", default="chain", help="the trained drafter's tree (draftsmith eval's --tree)")
    ap.add_argument("--prompt-lookup", type=int, default=10, metavar="K")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF generate and HF prompt lookup")
    ap.add_argument("--no-hf-generate", dest="hf_generate", action="store_false", help="skip HF generate only")
    ap.add_argument("--suffix-min-score", type=float, default=2.0,
                    help="SuffixDecoding drafts only when its draft's expected accepted tokens reach this "
                         "(0: always draft, as the reference implementation; 2 measured best on a CPU)")
    ap.add_argument("--no-ours-lookup", dest="ours_lookup", action="store_false", help="skip ours prompt lookup")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32",
                    help="the target's dtype (auto: bf16 on a CPU with native bf16)")
    add_forward_arg(ap, default="eager")
    add_common_args(ap, threads=True, threads_default=1, seed=True, cpu_layout=True)
    a = ap.parse_args(argv)

    def drafters(target):
        if not a.checkpoint:
            return []
        d = drafter_from_checkpoint(a.checkpoint, target)
        d.name = (read_manifest(a.checkpoint).get("recipe") or {}).get("name") or d.name
        return [d]

    b = setup(a, checkpoint=a.checkpoint, drafters=drafters)
    target, tok = b.target, b.target.tokenizer
    b.forward = use_fast_forward(target, a.forward)  # every decoder built from here on (plain included) uses it
    if a.workload == "humaneval":
        prompts = humaneval_prompts(tok, a.problems, a.samples)
    elif a.workload == "second":
        prompts = second_turn_prompts(target, a.prompts, a.first_tokens, b.out.parent / "first_answers.json")
    else:
        prompts = mtbench_prompts(tok, a.prompts, spread=True)
    trained = [(d, [(a.tree, parse_tree(a.tree, a.checkpoint))]) for d in b.drafters]
    runs, traffic = {}, {}
    for temp in a.temperature:
        sampling = SamplingParams(temp)
        label = "greedy" if sampling.greedy else f"T={temp}"
        methods = [ours(BASELINE, SpeculativeDecoder(target, sampling=sampling))]
        if a.hf and a.hf_generate:
            methods.append(hf_generate(target, sampling))
        for d, trees in trained:
            methods += [ours(f"ours {d.name} {lbl}", SpeculativeDecoder(target, d, tree=t, sampling=sampling))
                        for lbl, t in trees]
        extra, members = suffix_methods(target, sampling, trained, config=SuffixConfig(min_score=a.suffix_min_score),
                                        lookup_k=a.prompt_lookup,
                                        hf_lookup=a.hf, ours_lookup=a.ours_lookup)
        methods = methods + extra
        print(f"== {a.workload} {label}: {len(prompts)} prompts x {a.max_new_tokens} tokens; "
              f"{', '.join(m.name for m in methods)}", flush=True)
        got: dict[str, list] = {m.name: [] for m in methods}
        for m in methods:  # warm-up (forgotten by the suffix indexes)
            m.run(prompts[0].ids, 8, a.seed)
            if m.after_warmup is not None:
                m.after_warmup()
        compiling = {m.name: 0.0 for m in methods}
        for k, pr in enumerate(prompts):  # interleaved, a seeded shuffle per prompt (as eval.bench.run_bench)
            order = list(methods)
            random.Random(a.seed * 7919 + k).shuffle(order)
            for m in order:
                c0 = compile_seconds(target, b.drafters)
                r = m.run(pr.ids, a.max_new_tokens, a.seed + k)
                # a graph first compiled in this run (a prompt needing a larger cache, a new row bucket) is a
                # one-time cost of whichever method met it first: taken out of its time, and reported
                late = compile_seconds(target, b.drafters) - c0
                r.wall_s -= late
                compiling[m.name] += late
                got[m.name].append(r)
            print(f"[{k + 1}/{len(prompts)}] {pr.category}: " + ", ".join(
                f"{m.name} {len(got[m.name][-1].tokens)} tok {got[m.name][-1].wall_s:.2f}s" for m in methods),
                flush=True)
            runs[label] = figures(methods, prompts, got, members, sampling, a.max_new_tokens)
            runs[label]["compile_s_taken_out"] = {n: round(v, 1) for n, v in compiling.items()}
            traffic[label] = [{"prompt_ids": p.ids, "response_ids": r.tokens, "group": p.category}
                              for p, r in zip(prompts, got[BASELINE])]
            write(a, b, prompts, runs, traffic, done=False)
        print(table(runs[label]), flush=True)
        print(f"compiling taken out of the timed runs (s): {runs[label]['compile_s_taken_out']}", flush=True)
        print(json.dumps(runs[label]["suffix"], indent=1), flush=True)
    write(a, b, prompts, runs, traffic, done=True)
    return runs


def figures(methods, prompts, got, members, sampling, max_new_tokens) -> dict:
    out = bench_figures(methods, prompts, got, max_new_tokens)
    out["suffix"] = suffix_stats(members)
    if sampling.greedy:  # every method's output against plain decoding's, prompt by prompt
        ref = [r.tokens for r in got[BASELINE]]
        out["greedy_equal"] = {
            name: {"equal": sum(r.tokens == t for r, t in zip(rs, ref)), "prompts": len(ref),
                   "first_divergence": next((i for i, (r, t) in enumerate(zip(rs, ref)) if r.tokens != t), None)}
            for name, rs in got.items()}
    return out


def write(a, b, prompts, runs, traffic, done: bool) -> None:
    cfg = {k: v for k, v in vars(a).items()}
    cfg["subset"] = {"prompts": len(prompts), "workload": a.workload}
    report = {**provenance(), "config": cfg, "cpu_layout": b.layout, "dtype": str(b.target.dtype),
              "forward": b.forward, "complete": done, "runs": runs}
    write_json(b.out / "report.json", report)
    write_json(b.out / "traffic.json", traffic, indent=None)
    if done:
        print(f"wrote {b.out / 'report.json'} and traffic.json")


if __name__ == "__main__":
    main()
