"""The field's evaluation protocol: prompt sets, per-set figures and the suite's tables (``draftsmith bench suite``).

Sets (evaluation prompts only, never trained on):
  * ``mt-bench``: MT-Bench's 80 first turns;
  * ``mt-bench-2``: its 80 second turns, each after the target's own greedy answer to the first (decoded once by
    plain decoding and kept in the suite's output, so a rerun decodes the same conversations);
  * ``humaneval``: HumanEval's 164 problems as chat prompts ("Complete this Python function." and the stub).
GSM8K and Alpaca: no package in the registries this project installs from ships their prompts (searched:
gsm8k, gsm8k-dataset, grade-school-math, alpaca-eval 0.6.6, alpaca-farm 0.2.0, lm-eval 0.4.13 and
opencompass 0.5.4; the last four ship configurations only and download the data from a hub at run time), so
the suite names them as unavailable rather than leaving them out silently.

Every figure per set, temperature and method: tokens/s, tau (mean tokens per target forward, the final token
included), the draft acceptance rate, acceptance by position, the histogram of accepted drafts per step, draft ms
per step, and speedups against every plain decoding that ran (ours, HF ``generate``, llama.cpp's), named.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.chat import prompt_token_ids
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.eval.bench import is_plain
from draftsmith.eval.humaneval import humaneval_problems, humaneval_text
from draftsmith.eval.mtbench import Prompt, chat_ids, mtbench_prompts, mtbench_rows, spread
from draftsmith.target import dtype_name

#: The sets the suite decodes, in order: name -> what it is.
SETS = {
    "mt-bench": "MT-Bench first turns (80)",
    "mt-bench-2": "MT-Bench second turns after the target's own greedy first answers (80)",
    "humaneval": "HumanEval problems as chat prompts (164)",
}
#: Sets the field reports that no registry package ships here: name -> why the suite cannot run them.
UNAVAILABLE = {
    "gsm8k": "no package in the registries ships GSM8K's prompts (lm-eval and opencompass ship configurations "
             "only and download the data from a hub)",
    "alpaca": "no package in the registries ships Alpaca's prompts (alpaca-eval and alpaca-farm download them from "
              "a hub)",
}
FIRST_ANSWERS = "mt_bench_first_answers.jsonl"


def humaneval_prompts(tokenizer, n: int | None = None) -> list[Prompt]:
    """HumanEval problems (``n`` spread over the 164) as chat prompts (`humaneval_text`)."""
    return [Prompt(int(str(prob["task_id"]).rpartition("/")[2]), "humaneval", humaneval_text(prob),
                   chat_ids(tokenizer, humaneval_text(prob))) for prob in spread(humaneval_problems(), n)]


def first_answers(target, rows: list[dict], max_new_tokens: int, path: Path) -> dict[int, str]:
    """The target's own greedy answers to ``rows``' first turns (plain decoding, ``max_new_tokens`` at most), read
    from ``path`` where an earlier run of the same target, dtype and length wrote them, else decoded and written
    there."""
    key = {"target": target.fingerprint, "dtype": dtype_name(target.dtype), "max_new_tokens": max_new_tokens}
    have: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("key") == key:
                have[int(row["question_id"])] = row["answer"]
    todo = [r for r in rows if int(r["question_id"]) not in have]
    if todo:
        dec, eos = SpeculativeDecoder(target), set(target.eos_token_ids)
        with path.open("a") as f:
            for r in todo:
                res = dec.generate(chat_ids(target.tokenizer, r["turns"][0]), max_new_tokens, seed=0)
                toks = [t for t in res.tokens if t not in eos]
                answer = target.tokenizer.decode(toks, skip_special_tokens=True)
                have[int(r["question_id"])] = answer
                f.write(json.dumps({"key": key, "question_id": int(r["question_id"]), "answer": answer}) + "\n")
        print(f"mt-bench-2: decoded {len(todo)} first answers of the target ({max_new_tokens} tokens at most), "
              f"kept in {path}")
    return have


def mtbench_second_turns(target, n: int | None, first_answer_tokens: int, out: Path) -> list[Prompt]:
    """MT-Bench second turns, each after its first turn and the target's own greedy first answer."""
    rows = mtbench_rows(n)
    answers = first_answers(target, rows, first_answer_tokens, out / FIRST_ANSWERS)
    prompts = []
    for r in rows:
        qid = int(r["question_id"])
        msgs = [{"role": "user", "content": r["turns"][0]}, {"role": "assistant", "content": answers[qid]},
                {"role": "user", "content": r["turns"][1]}]
        prompts.append(Prompt(qid, r["category"], r["turns"][1], prompt_token_ids(target.tokenizer, msgs)))
    return prompts


def set_prompts(name: str, target, n: int | None, first_answer_tokens: int, out: Path) -> list[Prompt]:
    """The prompts of the suite's set ``name`` (``n`` spread over it, or all)."""
    if name in UNAVAILABLE:
        raise ValueError(f"set {name!r} cannot run here: {UNAVAILABLE[name]}")
    if name == "mt-bench":
        return mtbench_prompts(target.tokenizer, n, spread=True)
    if name == "mt-bench-2":
        return mtbench_second_turns(target, n, first_answer_tokens, out)
    if name == "humaneval":
        return humaneval_prompts(target.tokenizer, n)
    raise ValueError(f"unknown set {name!r}: known {sorted(SETS)}, unavailable here {sorted(UNAVAILABLE)}")


def rows_of(set_name: str, report: dict) -> list[dict]:
    """One row per temperature and method of a set's ``draftsmith eval`` report: every figure of the protocol."""
    rows = []
    for label, figs in report["runs"].items():
        plains = {n: s["tokens_per_s"] for n, s in figs["methods"].items() if is_plain(n)}
        for name, s in figs["methods"].items():
            ms = s.get("step_ms") if s.get("time_shares") and not is_plain(name) else None
            rows.append({
                "set": set_name, "sampling": label, "method": name, "plain": is_plain(name),
                "prompts": figs["prompts"], "max_new_tokens": figs["max_new_tokens"],
                "tokens": s.get("tokens"), "tokens_per_s": s["tokens_per_s"], "tau": s["tau"],
                "acceptance_rate": s.get("acceptance_rate"), "mean_draft_len": s.get("mean_draft_len"),
                "acceptance_by_position": s.get("acceptance_by_position") or [],
                "accepted_hist": s.get("accepted_hist") or [],
                "draft_ms_per_step": ms["draft"] if ms else None,
                "speedup": {b: (s["tokens_per_s"] / tps if tps > 0 else 0.0) for b, tps in plains.items()},
                "fastest_plain": max(plains, key=plains.get) if plains else None,
            })
    return rows


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(suite: dict) -> str:
    """The suite's tables: one per set and sampling, every method's figures and speedups against each plain."""
    env, m = suite["environment"], suite["environment"].get("machine") or {}
    code = suite["environment"].get("code") or {}
    lines = ["# Evaluation suite", "",
             f"Machine: {m.get('cpu_kind', '?')}, {m.get('cpu_count', '?')} cores, {m.get('memory_gib', '?')} GiB; "
             f"torch {env.get('torch')} ({env.get('torch_threads')} threads), transformers {env.get('transformers')}; "
             f"date {suite['date']}; code {code.get('commit', 'not a git checkout')}"
             f"{' with local changes' if code.get('dirty') else ''}.", "",
             f"Command: `{suite['command']}`", "",
             f"Target: {suite['target']['name']} ({suite['target']['dtype']}), fingerprint "
             f"{suite['target']['fingerprint'][:12]}. tau = tokens per target forward (final token included); "
             "acceptance rate = accepted / drafted tokens (a tree's nodes all count as drafted); hist = steps that "
             "accepted 0, 1, 2, ... drafts; speedups against every plain decoding that ran in the same run.", ""]
    for name, why in suite["unavailable"].items():
        lines.append(f"- {name}: not run, {why}.")
    lines.append("")
    by = {}
    for r in suite["rows"]:
        by.setdefault((r["set"], r["sampling"]), []).append(r)
    for (set_name, label), rows in by.items():
        plains = [r["method"] for r in rows if r["plain"]]
        lines += [f"## {set_name}, {label}: {rows[0]['prompts']} prompts x {rows[0]['max_new_tokens']} tokens", "",
                  "| method | tok/s | tau | accept rate | accept@1..4 | hist | draft ms/step | "
                  + " | ".join(f"x {p}" for p in plains) + " |",
                  "|---|---|---|---|---|---|---|" + "---|" * len(plains)]
        for r in rows:
            acc = ",".join(_f(a) for a in r["acceptance_by_position"][:4]) or "-"
            hist = "/".join(str(h) for h in r["accepted_hist"][:8]) if not r["plain"] else "-"
            lines.append(f"| {r['method']} | {r['tokens_per_s']:.2f} | {r['tau']:.3f} | "
                         f"{_f(r['acceptance_rate'], '.3f')} | {acc} | {hist} | {_f(r['draft_ms_per_step'])} | "
                         + " | ".join(_f(r["speedup"].get(p)) for p in plains) + " |")
        lines.append("")
    if suite.get("forecasts"):
        lines += ["## Forecasts against measurements", "",
                  "The trees stage's forecast (held-out acceptance and measured step costs) for each built tree, and "
                  "the training-time probe's prediction from logged top-1 accuracies (1 + sum_k prod_j<=k top1_j), "
                  "beside the tau measured here. A speed's miss is split into its factors: speed ratio = tau ratio / "
                  "step-cost ratio x rest (the step cost: a step's time, drafting included, in plain steps; the rest: "
                  "the prefill and time outside the steps).", "",
                  "| set | sampling | method | source | forecast tau | measured tau | ratio | forecast speedup | "
                  "measured speedup | ratio | forecast step cost | measured step cost | ratio | rest |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for f in suite["forecasts"]:
            nums = (f["forecast_tau"], f["measured_tau"], f["tau_ratio"], f.get("forecast_speedup"),
                    f.get("measured_speedup"), f.get("speedup_ratio"), f.get("forecast_step_cost"),
                    f.get("measured_step_cost"), f.get("step_cost_ratio"), f.get("rest_ratio"))
            lines.append(f"| {f['set']} | {f['sampling']} | {f['method']} | {f['source']} | "
                         + " | ".join(_f(x, ".3f") for x in nums) + " |")
        lines.append("")
    lines += ["Per-set reports (every prompt, plots): " + ", ".join(f"[{s}]({s}/report.md)" for s in suite["sets"]),
              ""]
    return "\n".join(lines)


def plot(suite: dict, out: Path) -> list[str]:
    """tau and speedup against the fastest plain decoding, per set and method, one figure per sampling."""
    import matplotlib  # noqa: PLC0415 (only where plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    files = []
    for label in sorted({r["sampling"] for r in suite["rows"]}):
        rows = [r for r in suite["rows"] if r["sampling"] == label and not r["plain"]]
        if not rows:
            continue
        sets = list(dict.fromkeys(r["set"] for r in rows))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        w = 0.8 / len(methods)
        for j, meth in enumerate(methods):
            got = {r["set"]: r for r in rows if r["method"] == meth}
            xs = [i + j * w for i in range(len(sets))]
            axes[0].bar(xs, [got[s]["tau"] if s in got else 0 for s in sets], w, label=meth)
            axes[1].bar(xs, [got[s]["speedup"].get(got[s]["fastest_plain"], 0) if s in got else 0 for s in sets], w,
                        label=meth)
        for ax, what in zip(axes, ("tau (tokens per target forward)", "speedup vs the fastest plain decoding")):
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(sets))], sets)
            ax.set(ylabel=what, title=f"{what.split(' (')[0]} by set ({label})")
        axes[1].axhline(1.0, color="gray", lw=0.8)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        files.append(f"suite_{label.replace('=', '')}.png")
        fig.savefig(out / files[-1], dpi=110)
        plt.close(fig)
    return files
