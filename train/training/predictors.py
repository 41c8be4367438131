"""The traces stage and predictor training, as the pipeline and the CLI run them.

    draftsmith traces RECIPE [--checkpoint CKPT] [--prompts 100] [--temperature 0 0.7] ...
    draftsmith predictors TRACES_DIR [--kinds disco specdec] [--out DIR]

Drafters: a checkpoint directory (default: the recipe's ``final``), or the untrained
baselines ``first-layers:N`` and ``early-exit:L``. Prompts: the first user turn (with
its system prompt) of the recipe's ``data/train.jsonl`` conversations, never MT-Bench.
Predictors are trained per temperature recorded, into ``OUT/t{T}/disco`` and
``OUT/t{T}/specdec``, each with its calibration figures.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from draftsmith import registry
from draftsmith.checkpoint import command_line, environment, resolve_drafter
from draftsmith.classifiers.traces import (TraceError, cost_model, describe, drafter_identity, load_traces, record,
                                           save_traces, timestamp)
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.cpu_layout import apply_cpu_layout  # decoding layout, as eval uses
from draftsmith.engine.sampling import SamplingParams
from draftsmith.target import Target, check_fingerprint
from draftsmith.train.data.generate import prompt_ids

log = logging.getLogger(__name__)


def load_drafter(spec: str | Path, target: Target) -> tuple[Any, dict]:
    """(decoder drafter, identity) for a checkpoint directory, ``first-layers:N`` or ``early-exit:L``."""
    s = str(spec)
    d = resolve_drafter(s, target)
    return d, drafter_identity(d, s if Path(s).is_dir() else None)


def training_prompts(path: Path, tokenizer, n: int, max_len: int) -> tuple[list[list[int]], dict]:
    """First user turns (with the system prompt) of a regenerated data file; bad or long rows counted."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `draftsmith data RECIPE` first (traces use the "
                                f"recipe's training prompts, never MT-Bench)")
    out, skipped = [], {"malformed": 0, "too_long": 0}
    for line in path.read_text().splitlines():
        if len(out) >= n:
            break
        try:
            row = json.loads(line)
            user = next(m for m in row["messages"] if m["role"] == "user")
            msgs = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [user]
            ids = prompt_ids(tokenizer, msgs)
        except (json.JSONDecodeError, KeyError, TypeError, StopIteration, ValueError):
            skipped["malformed"] += 1
            continue
        if len(ids) > max_len:
            skipped["too_long"] += 1
            continue
        out.append(ids)
    if not out:
        raise TraceError(f"{path}: no usable training prompt ({skipped})")
    return out, skipped


def stage_traces(recipe, target: Target, *, checkpoint: str | None = None, prompts: int = 100,
                 max_new_tokens: int = 128, draft_len: int = 8, temperatures=(0.0, 0.7), out: str | None = None,
                 calibration_every: int = 5, seed: int = 0) -> dict:
    """Record acceptance traces of the recipe's drafter on its training prompts (see traces.py)."""

    spec = checkpoint or str(recipe.out / "final")
    drafter, ident = load_drafter(spec, target)
    max_depth = capabilities(drafter).max_depth
    if max_depth:
        draft_len = min(draft_len, max_depth)
    apply_cpu_layout(target, drafter)
    room = target.context_length - max_new_tokens - draft_len - 1
    ids, skipped = training_prompts(recipe.out / "data" / "train.jsonl", target.tokenizer, prompts, room)
    out_dir = Path(out) if out else recipe.out / "traces"
    rows, steps = [], []
    for temp in temperatures:
        sampling = SamplingParams(float(temp))
        r, s = record(target, drafter, ids, sampling, draft_len=draft_len, max_new_tokens=max_new_tokens, seed=seed,
                      progress=lambda k, res: print(f"traces T={temp} [{k + 1}/{len(ids)}] {len(res.tokens)} tokens, "
                                                    f"tau {res.tau:.2f}", flush=True))
        print(f"traces T={temp}: {describe(r)}")
        rows += r
        steps += s
    cost = cost_model(target, steps, draft_len)
    meta = {"target": {"name": target.name, "fingerprint": target.fingerprint}, "drafter": ident,
            "prompts": len(ids), "prompts_skipped": skipped, "source": str(recipe.out / "data" / "train.jsonl"),
            "max_new_tokens": max_new_tokens, "draft_len": draft_len, "temperatures": list(map(float, temperatures)),
            "cost": cost, "summary": describe(rows), "command": command_line(), "environment": environment(),
            "created": timestamp()}
    save_traces(out_dir, rows, meta, calibration_every)
    return {"out": str(out_dir), **meta}


def temperature_dir(out: Path, temperature: float) -> Path:
    return out / f"t{float(temperature):g}"


def train_predictors(traces_dir: str | Path, target: Target, *, kinds=None, out: str | None = None,
                     max_len: int = 8, epochs: int = 20, seed: int = 0) -> dict:
    """Train the length predictors ``kinds`` (default: every registered one, DISCO and SpecDec++) for every
    temperature of a trace set; returns calibration figures."""
    fits = registry.predictors()
    unknown = sorted(set(kinds or ()) - set(fits))
    if unknown:
        raise ValueError(f"unknown predictor kinds {unknown}; known: {sorted(fits)}")
    traces_dir = Path(traces_dir)
    tr_all, cal_all = load_traces(traces_dir, "train"), load_traces(traces_dir, "calibration")
    check_fingerprint(tr_all.meta["target"]["fingerprint"], target, what=f"traces {traces_dir}")
    out = Path(out) if out else traces_dir.parent / "predictors"
    temps = tr_all.meta.get("temperatures") or sorted({float(t) for t in tr_all.columns["temperature"]})
    result: dict = {}
    for t in temps:
        tr, cal = tr_all.at_temperature(t), cal_all.at_temperature(t)
        where = temperature_dir(out, t)
        res = {}
        for name, fit in fits.items():
            if kinds is None or name in kinds:
                res[name] = _headline(fit(tr, cal, target, where / name, temperature=float(t), traces=str(traces_dir),
                                          max_len=max_len, epochs=epochs, seed=seed, log=log.info))
        result[f"{float(t):g}"] = res
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def _headline(cal: dict) -> dict:
    q = cal.get("quality") or {}
    fx = cal["fixed"]
    return {"mode": cal.get("mode") or ("lag" if cal.get("lag", True) else "no lag"),
            "threshold": cal["tuning"]["threshold"], "cap": cal["tuning"].get("cap"),
            "roc_auc": q.get("roc_auc"), "ece": q.get("ece"),
            "brier": q.get("brier"), "simulated_tokens_per_cost": cal["tuning"]["simulated"]["tokens_per_cost"],
            "simulated_mean_draft_len": cal["tuning"]["simulated"]["mean_draft_len"],
            "best_fixed_k": fx["best_k"], "best_fixed_tokens_per_cost": fx["best"]["tokens_per_cost"],
            "simulated_gain_over_best_fixed": cal["tuning"]["simulated"]["tokens_per_cost"] /
            fx["best"]["tokens_per_cost"] - 1 if fx["best"]["tokens_per_cost"] else None}


def format_summary(result: dict) -> str:
    lines = ["temperature  predictor  mode     threshold  cap  ROC AUC  ECE     sim. gain vs best fixed K (K)"]
    for t, res in result.items():
        for kind, h in res.items():
            auc = "-" if h["roc_auc"] is None else f"{h['roc_auc']:.3f}"
            g = h["simulated_gain_over_best_fixed"]
            lines.append(f"{t:<12} {kind:<10} {h['mode']:<8} {h['threshold']:<10.3f} {h.get('cap') or '-':<4} "
                         f"{auc:<8} {h['ece']:<7.3f} "
                         f"{'-' if g is None else f'{100 * g:+.1f}%'} ({h['best_fixed_k']})")
    return "\n".join(lines)

