"""Held-out acceptance of every checkpoint a training run saved: how acceptance grows with the data seen.

    python -m benchmarks.heldout_curve runs/e3-big [--threads 2] [--out FILE]

For each ``checkpoints/step-N`` of the run (the last one is what ``final`` holds), in step order, the held-out
figures of the run's report (MT-Bench first-turn answers of the target, ``cache/heldout``): per-step (or per-head)
top-1 and the predicted chain acceptance length. The tokens seen are the step's share of the run's assistant
tokens (its epochs over the training cache; unknown when ``train.max_steps`` ended it). An intermediate checkpoint
is not a run trained on that much data: its learning rate has not decayed yet, so the curve is a lower bound on
what a run stopped there would reach.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.checkpoint import load_checkpoint
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.eval.head_accuracy import head_accuracy
from draftsmith.target import load_target


def figures(model, cache: HiddenCache, target) -> dict:
    own = getattr(model, "heldout_metrics", None)
    got = own(cache, target) if callable(own) else None
    if got is not None:
        return {"top1": got["step_top1"], "conditional": got["step_top1_conditional"],
                "predicted_chain_tau": got["predicted_chain_tau"], "positions": got["positions"]}
    acc = head_accuracy(model, cache, model.num_heads)
    return {"top1": acc["top1"], "predicted_chain_tau": acc["predicted_chain_tau"], "positions": acc["positions"][0]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a training run's directory (runs/NAME)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file for the rows (default: RUN/heldout_curve.json)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    run = Path(a.run)
    ckpts = sorted((p for p in (run / "checkpoints").glob("step-*") if p.is_dir()),
                   key=lambda p: int(p.name.split("-")[1]))
    if not ckpts:
        raise SystemExit(f"{run}/checkpoints holds no step-N checkpoint")
    target = load_target("smollm2-135m-instruct")
    train_idx = json.loads((run / "cache" / "train" / "index.json").read_text())
    held = HiddenCache(run / "cache" / "heldout", target)
    last = int(ckpts[-1].name.split("-")[1])
    tr = json.loads((run / "recipe.json").read_text()).get("train", {}) if (run / "recipe.json").exists() else {}
    # the tokens the whole run trained on: its epochs over the cache, unless a step cap ended it (then unknown)
    total = None if tr.get("max_steps") else float(tr.get("epochs", 1)) * int(train_idx["loss_tokens"])
    rows = []
    for p in ckpts:
        step = int(p.name.split("-")[1])
        t0 = time.time()
        model, _ = load_checkpoint(p, target)
        f = figures(model, held, target)
        row = {"checkpoint": str(p), "step": step, "run_share": step / last,
               "assistant_tokens_seen": None if total is None else round(step / last * total), **f}
        rows.append(row)
        seen = "?" if total is None else f"~{row['assistant_tokens_seen']}"
        print(f"{p.name}: {seen} assistant tokens seen, top-1 by depth "
              f"{[round(x, 3) for x in f['top1']]}, predicted chain tau {f['predicted_chain_tau']:.3f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    out = Path(a.out) if a.out else run / "heldout_curve.json"
    out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
