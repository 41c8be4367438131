"""Writing benchmark reports: report.json, report.md and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from draftsmith.eval.bench import table


def _plots(runs: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for label, fig_data in runs.items():
        methods = fig_data["methods"]
        tag = label.replace(" ", "_").replace("=", "")
        # acceptance by draft position
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, s in methods.items():
            acc = s.get("acceptance_by_position") or []
            xs = [i + 1 for i, a in enumerate(acc) if a is not None]
            if xs:
                ax.plot(xs, [a for a in acc if a is not None], marker="o", label=name)
        ax.set(xlabel="draft position i", ylabel="P(i accepted | i-1 accepted)", ylim=(0, 1.05),
               title=f"Acceptance by draft position ({label})")
        if ax.lines:
            ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(f"acceptance_{tag}.png")
        fig.savefig(out / files[-1], dpi=120)
        plt.close(fig)
        # tau by category
        cats = sorted({c for s in methods.values() for c in s["tau_by_category"]})
        fig, ax = plt.subplots(figsize=(11, 4))
        w = 0.8 / max(1, len(methods))
        for j, (name, s) in enumerate(methods.items()):
            ax.bar([i + j * w for i in range(len(cats))], [s["tau_by_category"].get(c, 0.0) for c in cats], w,
                   label=name)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cats))], cats, rotation=30, fontsize=8)
        ax.set(ylabel="tau (tokens per target forward)", title=f"tau by MT-Bench category ({label})")
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
        fig.tight_layout()
        files.append(f"tau_by_category_{tag}.png")
        fig.savefig(out / files[-1], dpi=120)
        plt.close(fig)
        # tokens/s by method
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(methods)
        ax.barh(names, [methods[n]["tokens_per_s"] for n in names])
        ax.set(xlabel="tokens/s", title=f"Throughput by method ({label})")
        ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        files.append(f"tokens_per_s_{tag}.png")
        fig.savefig(out / files[-1], dpi=120)
        plt.close(fig)
    return files


def _markdown(report: dict) -> str:
    lines = ["# Decoding benchmark", "", f"Command: `{report['command']}`", ""]
    cfg = report["config"]
    lines += [f"{cfg.get('prompt_set', 'MT-Bench first turns')}: {cfg.get('prompts_decoded', cfg['prompts'])} prompts, "
              f"{cfg['max_new_tokens']} new tokens, "
              f"methods interleaved per prompt. tau = tokens / target forwards that emit tokens (final token "
              f"included; plain decoding = 1.00; see draftsmith.engine.metrics). Speedups name their baseline.", ""]
    for label, figs in report["runs"].items():
        lines += [f"## {label}", "", "```", table(figs), "```", ""]
        lines += ["| method | tokens/s | tau | speedup | time shares (draft/verify/other) | ms per step "
                  "(draft/verify/other) |", "|---|---|---|---|---|---|"]
        for name, s in figs["methods"].items():
            sp = "; ".join(f"{x['speedup']:.2f}x vs {x['baseline']}" for x in s["speedup"]) or "-"
            ts = s.get("time_shares")
            share = f"{ts['draft']:.2f}/{ts['verify']:.2f}/{ts['other']:.2f}" if ts else "-"
            ms = s.get("step_ms") if ts else None
            ms = f"{ms['draft']:.1f}/{ms['verify']:.1f}/{ms['other']:.1f}" if ms else "-"
            lines.append(f"| {name} | {s['tokens_per_s']:.2f} | {s['tau']:.3f} | {sp} | {share} | {ms} |")
        lines.append("")
    env = report["environment"]
    lines += ["## Environment", "", "```", json.dumps(env, indent=2), "```", ""]
    lines += ["Plots: " + ", ".join(f"[{f}]({f})" for f in report["plots"]), ""]
    return "\n".join(lines)


def write_report(out: str | Path, runs: dict, config: dict, command: str, environment: dict) -> dict:
    """Write report.json, report.md and the plots into ``out``; returns the report dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "config": config, "environment": environment, "runs": runs}
    report["plots"] = _plots(runs, out)
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out / "report.json")
    (out / "report.md").write_text(_markdown(report))
    return report
