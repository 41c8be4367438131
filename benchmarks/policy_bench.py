"""Draft-length policies side by side for one chain drafter: the acceptance predictors' table.

    python -m benchmarks.policy_bench CKPT --predictors RUN/predictors --prompts 16 \
        --max-new-tokens 128 --temperature 0 0.7 --out runs/policies

Methods, all on the same drafter and the lossless decoder, interleaved per prompt
(eval/bench.py): plain decoding (the baseline), fixed K = 1..8, confidence 0.4
(stop before a candidate whose top-1 draft probability is below 0.4), Hugging Face's
ROC refit (classifiers/roc.py), DISCO and SpecDec++ (classifiers/), the last two
loaded from ``--predictors`` (trained per temperature by `draftsmith predictors`; a
predictor made for another drafter, target or temperature is a clear error).

Columns: tokens/s, speedup vs plain (ours), tau, mean draft length, drafted tokens
wasted per accepted one, drafting time per drafted token (what a predictor adds per
token shows here). Under greedy every method's tokens are compared with plain
decoding's, prompt by prompt ("identical"): with ``--prompts 80`` that is the greedy
equality check on all MT-Bench first turns. Classifier quality on the calibration
split (ROC AUC, expected calibration error, the simulated gain over the best fixed K)
is copied from the predictors. Writes OUT/report.json and OUT/report.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import add_common_args, draft_ms_per_token, parser, provenance, recording, setup, write_json
from draftsmith.classifiers.disco import model as disco
from draftsmith.classifiers.roc import RocRefitStop
from draftsmith.classifiers.specdec import model as specdec
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.bench import BASELINE, ours, run_bench
from draftsmith.train.training.predictors import load_drafter, temperature_dir


def build_parser() -> argparse.ArgumentParser:
    ap = parser("policy_bench", __doc__)
    ap.add_argument("drafter", help="drafter checkpoint, or first-layers:N / early-exit:L")
    ap.add_argument("--predictors", default=None, help="directory written by `draftsmith predictors` "
                    "(without it: fixed K, confidence and ROC refit only)")
    add_common_args(ap, target_default=None, threads=True, device=True, seed=True, cpu_layout=True, out="dir",
                    target_help="target name or local Hugging Face directory (default: the default target)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--fixed", type=int, nargs="+", default=list(range(1, 9)), help="fixed draft lengths")
    ap.add_argument("--max-len", type=int, default=8, help="cap of every dynamic policy")
    ap.add_argument("--confidence", type=float, default=0.4)
    return ap


def policies(a, target, drafter, ident: dict, temperature: float) -> list[tuple[str, object]]:
    """(name, policy) of every method for one temperature."""
    cap = capabilities(drafter).max_depth
    ks = sorted({min(k, cap) if cap else k for k in a.fixed})
    max_len = min(a.max_len, cap) if cap else a.max_len
    out = [(f"K={k}", FixedLength(k)) for k in ks]
    out += [(f"confidence {a.confidence}", ConfidenceStop(a.confidence, max_len)),
            ("ROC refit (HF)", RocRefitStop(a.confidence, max_len))]
    if a.predictors:
        where = temperature_dir(Path(a.predictors), temperature)
        if (where / "disco").exists():
            m = disco.load(where / "disco")
            disco.check_for(m, target, ident, temperature, f"DISCO {where / 'disco'}")
            out.append(("DISCO", disco.DiscoStop(m, min(max_len, int(m.meta.get("cap", max_len))))))
        if (where / "specdec").exists():
            head, man = specdec.load(where / "specdec", target)
            specdec.check_for(man, ident, temperature, f"SpecDec++ {where / 'specdec'}")
            head.to(next(target.model.parameters()).device)
            out.append(("SpecDec++", specdec.SpecDecStop(head, float(man["threshold"]),
                                                          min(max_len, int(man.get("cap", max_len))),
                                                          lag=bool(man.get("lag", True)))))
        if len(out) == len(ks) + 2:
            raise FileNotFoundError(f"{where}: no disco/ or specdec/ predictor for temperature {temperature}")
    return out


def _row(name: str, s: dict, base_tps: float | None) -> dict:
    return {"method": name, "tokens_per_s": s["tokens_per_s"], "speedup_vs_plain": (
        s["tokens_per_s"] / base_tps if base_tps else None), "tau": s["tau"], "mean_draft_len": s["mean_draft_len"],
        "wasted_per_accepted": s["wasted_per_accepted"], "draft_ms_per_token": s.get("draft_ms_per_token"),
        "identical_to_plain": s.get("identical_to_plain")}


def markdown(rows: list[dict]) -> str:
    lines = ["| method | tokens/s | speedup vs plain | tau | mean draft len | wasted/accepted | draft ms/token "
             "| identical to plain |", "|---|---|---|---|---|---|---|---|"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['method']} | {f(r['tokens_per_s'])} | {f(r['speedup_vs_plain'], 3)} | {f(r['tau'])} | "
                     f"{f(r['mean_draft_len'])} | {f(r['wasted_per_accepted'])} | {f(r['draft_ms_per_token'])} | "
                     f"{r['identical_to_plain'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    bench = setup(a)
    target = bench.target
    drafter, ident = load_drafter(a.drafter, target)
    bench.apply_layout(drafter)
    prompts = bench.prompts(a.prompts)
    report = {"drafter": ident, "target": {"name": target.name, "fingerprint": target.fingerprint},
              "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "runs": {}, "quality": {}}
    md = [f"# Draft-length policies: {ident['name']} on {target.name}", "",
          f"{len(prompts)} MT-Bench first turns, {a.max_new_tokens} new tokens, "
          "one interleaved run per temperature.", ""]
    for temp in a.temperature:
        sampling = SamplingParams(temp)
        label = "greedy" if sampling.greedy else f"T={temp}"
        pols = policies(a, target, drafter, ident, temp)
        methods = [ours(BASELINE, SpeculativeDecoder(target, sampling=sampling))]
        methods += [ours(name, SpeculativeDecoder(target, drafter, policy=p, sampling=sampling)) for name, p in pols]
        print(f"== {label}: {', '.join(m.name for m in methods)}", flush=True)
        wrapped, results = recording(methods)  # every result kept, for the per-prompt token comparison
        fig = run_bench(wrapped, prompts, a.max_new_tokens, seed=a.seed)
        base = fig["methods"][BASELINE]["tokens_per_s"]
        rows = []
        for m in methods:
            s = fig["methods"][m.name]
            rs = results[m.name][1:]  # the first call is the warm-up
            s["draft_ms_per_token"] = draft_ms_per_token(rs)
            if sampling.greedy and m.name != BASELINE:
                same = sum(r.tokens == b.tokens for r, b in zip(rs, results[BASELINE][1:]))
                s["identical_to_plain"] = f"{same}/{len(rs)}"
            rows.append(_row(m.name, s, base))
        report["runs"][label] = {"figures": fig, "table": rows}
        md += [f"## {label}", "", markdown(rows), ""]
        print(markdown(rows), flush=True)
    if a.predictors:
        summary = Path(a.predictors) / "summary.json"
        if summary.exists():
            report["quality"] = json.loads(summary.read_text())
            md += ["## Predictor quality on the calibration split (training prompts held out)", "",
                   "| temperature | predictor | mode | threshold | ROC AUC | ECE | Brier "
                   "| simulated gain vs best fixed K |",
                   "|---|---|---|---|---|---|---|---|"]
            for t, res in report["quality"].items():
                for kind, h in res.items():
                    g = h.get("simulated_gain_over_best_fixed")
                    md.append(f"| {t} | {kind} | {h.get('mode', '-')} | {h['threshold']:.3f} | "
                              f"{'-' if h['roc_auc'] is None else format(h['roc_auc'], '.3f')} | {h['ece']:.3f} | "
                              f"{h['brier']:.3f} | {'-' if g is None else f'{100 * g:+.1f}%'} "
                              f"(K={h['best_fixed_k']}) |")
    report.update(provenance())
    out = bench.out
    write_json(out / "report.json", report)
    (out / "report.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'report.json'} and report.md")
    return report


if __name__ == "__main__":
    main()
