"""``draftsmith bench suite``: the field's evaluation protocol for drafters, in one command.

    draftsmith bench suite CKPT... [--quick] [--sets mt-bench mt-bench-2 humaneval] [--temperature 0 1]
                           [--tree chain --tree built:best] [--suffix] [--no-hf] [--llamacpp shipped] [--no-vllm]
                           --out DIR

CKPT: drafter checkpoints and decoder-only drafters (``suffix``, ``prompt-lookup:K``, ``early-exit:L``), side by
side, or ``none``. Every set (eval/suite.py: MT-Bench first turns, MT-Bench second turns after the target's own
first answers, HumanEval; GSM8K and Alpaca are named as unavailable: no registry package ships them), at T=0 and
T=1, each checkpoint as a chain and in its built trees (``built:best`` where the trees stage built them),
interleaved per prompt with plain decoding: ours always, Hugging Face ``generate`` (``--no-hf`` leaves it out),
and at T=0 llama.cpp's (on the target's shipped GGUF, where ``scripts/llamacpp_env.sh`` built it; its server
interleaved with ours) and vLLM CPU's (where ``scripts/vllm_env.sh`` built it; after ours, in its own process).
The target and drafters load once; each set writes DIR/SET/report.{json,md} and its plots (``draftsmith eval``'s
report), and the suite writes DIR/suite.json (every row, the machine, versions, commit, command), DIR/suite.md and
DIR/suite_*.png.

Decoder-only drafters keep their state across sets: ``suffix``'s global index learns from every response of the
run, in order (as in a server), so later sets draft from what earlier sets decoded.

``--quick``: 8 prompts per set x 64 tokens (first answers of 64 tokens), a few minutes; the default is every
prompt x 128 tokens (first answers of 256), hours on a 2-core CPU. Every other option of ``draftsmith eval``
applies (``--dtype``, ``--forward``, ``--target``, ``--suffix-from-data`` ...).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from draftsmith.checkpoint import command_line, environment, read_manifest
from draftsmith.cli import eval as eval_cli
from draftsmith.eval.suite import SETS, UNAVAILABLE, markdown, plot, rows_of, set_prompts
from draftsmith.export.llamacpp import have_llamacpp
from draftsmith.export.vllm_check import add_vllm_plain
from draftsmith.engine.sampling import SamplingParams
from draftsmith.pipeline.stages import forecast_vs_measured
from draftsmith.target import dtype_name

QUICK = {"prompts": 8, "max_new_tokens": 64, "first_answer_tokens": 64}
FULL = {"prompts": None, "max_new_tokens": 128, "first_answer_tokens": 256}


def build_parser() -> argparse.ArgumentParser:
    ap = eval_cli.build_parser()
    ap.prog, ap.description = "draftsmith bench suite", __doc__
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=[*SETS, *UNAVAILABLE],
                    help=f"prompt sets, in order (default: {' '.join(SETS)}); {', '.join(UNAVAILABLE)}: not shipped "
                         "by any registry package (named in the results)")
    ap.add_argument("--quick", action="store_true", help="8 prompts per set x 64 tokens: a few minutes")
    ap.add_argument("--first-answer-tokens", type=int, default=None,
                    help="mt-bench-2: length cap of the target's own first answers (default 256; 64 with --quick)")
    ap.add_argument("--no-hf", dest="plain", action="store_false", help="leave Hugging Face generate out")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave vLLM's plain decoding out")
    # the suite's defaults, where they differ from `draftsmith eval`'s
    ap.set_defaults(temperature=[0.0, 1.0], plain=True, prompts=None, max_new_tokens=None, llamacpp=None)
    return ap


def _vllm(a: argparse.Namespace, target, where: Path):
    """`evaluate`'s ``more_plain``: vLLM's plain decoding of the set's prompts (greedy runs only), or None."""
    if not a.vllm:
        return None

    def add(figures: dict, prompts: list, sampling: SamplingParams, label: str) -> None:
        if add_vllm_plain(figures, target, prompts, a.max_new_tokens, where / f"vllm_{label}.json", sampling=sampling):
            print(f"vLLM plain: {figures['methods']['vLLM plain']['tokens_per_s']:.2f} tok/s")
        elif figures.get("vllm") and sampling.greedy:
            print(f"vLLM: left out ({figures['vllm'].splitlines()[0]})")
    return add


def _forecasts(a: argparse.Namespace, loaded, set_name: str, report: dict) -> list[dict]:
    """Per checkpoint and sampling on this set: the trees stage's forecast for its built trees beside the measured
    tau and speedup (`forecast_vs_measured`), and the training-time probe's last predicted and measured tau
    (``training_timing.probes``, where the recipe's ``train.probe_every`` ran it) beside the chain's tau here."""
    rows = []
    for c, (d, _) in zip(a.checkpoint, loaded.drafters):  # no drafters for "none"
        if not Path(c).is_dir():  # decoder-only drafters (suffix, ...): nothing forecast
            continue
        probes = ((read_manifest(c).get("metrics") or {}).get("training_timing") or {}).get("probes") or []
        for label, figs in report["runs"].items():
            for method, fc in forecast_vs_measured(figs, Path(c), a.tree, d.name).items():
                rows.append({"set": set_name, "sampling": label, "method": method, "source": "trees stage",
                             **{k: v for k, v in fc.items() if not k.startswith("heldout_")}})
                if "heldout_forecast_tau" in fc:  # the same tree forecast on the held-out MT-Bench answers
                    rows.append({"set": set_name, "sampling": label, "method": method,
                                 "source": "trees stage, held-out MT-Bench answers",
                                 "forecast_tau": fc["heldout_forecast_tau"], "measured_tau": fc["measured_tau"],
                                 "tau_ratio": fc["heldout_tau_ratio"],
                                 "forecast_speedup": fc.get("heldout_forecast_speedup"),
                                 "measured_speedup": fc.get("measured_speedup"),
                                 "speedup_ratio": fc.get("heldout_speedup_ratio")})
            chain = figs["methods"].get(f"ours {d.name} chain")
            if probes and chain and probes[-1].get("tau_sim"):
                p = probes[-1]
                rows.append({"set": set_name, "sampling": label, "method": f"ours {d.name} chain",
                             "source": f"training probe (step {p.get('step')})", "forecast_tau": p["tau_sim"],
                             "probe_tau": p.get("tau_real"), "measured_tau": round(chain["tau"], 3),
                             "tau_ratio": round(chain["tau"] / p["tau_sim"], 3)})
    return rows


def main(argv: list[str]) -> int:
    suite_main(argv)
    return 0


def suite_main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    if a.prompts_file:
        raise ValueError("bench suite decodes its own sets; for your own prompts use `draftsmith eval --prompts-file`")
    unavailable = [s for s in a.sets if s in UNAVAILABLE]
    for s in unavailable:
        print(f"set {s}: not run, {UNAVAILABLE[s]}")
    sets = [s for s in a.sets if s in SETS]
    if not sets:
        raise ValueError(f"no set to run: {', '.join(a.sets)} cannot run here")
    size = QUICK if a.quick else FULL
    n = a.prompts if a.prompts is not None else size["prompts"]
    a.max_new_tokens = a.max_new_tokens or size["max_new_tokens"]
    first_tokens = a.first_answer_tokens or size["first_answer_tokens"]
    a.tree = a.tree or ["chain", "built:best"]
    if a.llamacpp is None:  # the shipped file where llama.cpp is built; named as left out otherwise
        why = have_llamacpp()
        a.llamacpp = "shipped" if why is None else ""
        if why:
            print(f"llama.cpp: left out ({why.splitlines()[0]})")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    loaded = eval_cli.load_for_eval(a)
    target = loaded.target
    reports, forecasts = {}, []
    for s in sets:
        prompts = set_prompts(s, target, n, first_tokens, out)
        print(f"=== set {s}: {len(prompts)} prompts x {a.max_new_tokens} tokens", flush=True)
        report = eval_cli.evaluate(a, loaded, prompts, out / s, _vllm(a, target, out / s), SETS[s])
        reports[s] = report
        forecasts += _forecasts(a, loaded, s, report)
    suite = {"command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "environment": environment(), "sets": sets, "descriptions": {s: SETS[s] for s in sets},
             "unavailable": dict(UNAVAILABLE),
             "quick": a.quick, "checkpoints": a.checkpoint, "trees": a.tree, "temperatures": a.temperature,
             "max_new_tokens": a.max_new_tokens, "first_answer_tokens": first_tokens,
             "target": {"name": target.name, "fingerprint": target.fingerprint, "dtype": dtype_name(target.dtype)},
             "rows": [r for s in sets for r in rows_of(s, reports[s])], "forecasts": forecasts,
             "wall_s": round(time.time() - t0, 1)}
    suite["plots"] = plot(suite, out)
    tmp = out / "suite.json.tmp"
    tmp.write_text(json.dumps(suite, indent=2, default=str))
    os.replace(tmp, out / "suite.json")
    (out / "suite.md").write_text(markdown(suite))
    print(markdown(suite))
    print(f"wrote {out / 'suite.json'}, suite.md and {len(suite['plots'])} plots in {suite['wall_s']:.0f} s")
    return suite
