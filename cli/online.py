"""``draftsmith online``: the continual distillation job and its tools.

    draftsmith online RECIPE --logs DIR [--once] [--state DIR] [--publish DIR] [key=value ...]
    draftsmith online rollback --publish DIR [--to VERSION]
    draftsmith online status --state DIR [--publish DIR]
    draftsmith online import OPENAI.jsonl --logs DIR [--target NAME]

The job tails DIR (written by ``draftsmith serve`` or by ``online import``),
updates the recipe's drafter every ``online.every_records`` records or
``online.every_seconds`` seconds, and publishes a candidate that passes the
gate on held-back traffic (docs/online.md).
"""

from __future__ import annotations

import argparse
import json

import torch

from draftsmith.publish import PublishStore
from draftsmith.recipe import load_recipe
from draftsmith.target import default_device, load_target
from draftsmith.traffic import import_openai_logs
from draftsmith.train.online.ledger import Ledger
from draftsmith.train.online.job import OnlineJob


def main(argv: list[str]) -> int:
    """Entry point of ``draftsmith online``."""
    if argv[:1] == ["rollback"]:
        ap = argparse.ArgumentParser(prog="draftsmith online rollback")
        ap.add_argument("--publish", required=True, help="publish directory")
        ap.add_argument("--to", default=None, help="version to switch to (default: the one before current)")
        a = ap.parse_args(argv[1:])
        store = PublishStore(a.publish)
        before = store.current()
        v = store.rollback(a.to)
        print(f"current: {before} -> {v} (kept: {', '.join(store.versions())})")
        return 0
    if argv[:1] == ["status"]:
        ap = argparse.ArgumentParser(prog="draftsmith online status")
        ap.add_argument("--state", required=True, help="the job's state directory")
        ap.add_argument("--publish", default=None)
        a = ap.parse_args(argv[1:])
        out = {"counts": Ledger(a.state).counts(), "updates": len(Ledger(a.state).updates())}
        if a.publish:
            st = PublishStore(a.publish)
            out["published"] = {"current": st.current(), "kept": st.versions()}
        print(json.dumps(out, indent=2))
        return 0
    if argv[:1] == ["import"]:
        ap = argparse.ArgumentParser(prog="draftsmith online import")
        ap.add_argument("source", help="JSONL of {request, response} OpenAI chat-completions pairs")
        ap.add_argument("--logs", required=True, help="log directory the job tails")
        ap.add_argument("--target", default="smollm2-135m-instruct", help="the target that wrote the responses")
        ap.add_argument("--max-tokens", type=int, default=4096, help="longer pairs are skipped as oversized")
        a = ap.parse_args(argv[1:])
        counts = import_openai_logs(a.source, a.logs, load_target(a.target), max_tokens=a.max_tokens)
        print(json.dumps(counts, indent=2))
        return 0
    ap = argparse.ArgumentParser(prog="draftsmith online", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="recipe YAML or built-in name (e.g. online)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. online.every_records=32")
    ap.add_argument("--logs", required=True, help="log directory to tail")
    ap.add_argument("--once", action="store_true", help="apply what is in the logs now, then exit")
    ap.add_argument("--state", default=None, help="state directory (default: online.state_dir or OUT/online)")
    ap.add_argument("--publish", default=None, help="publish directory (default: online.publish_dir or OUT/publish)")
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    recipe = load_recipe(a.recipe, a.overrides)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    if recipe.dtype != "float32":  # the job trains on the target's states as well as decoding with it
        print(f"online: the target runs in float32 (updates train on its states); recipe dtype {recipe.dtype} "
              f"is for the data, cache and bench stages and for `draftsmith serve --dtype`")
    target = load_target(recipe.target, device=default_device(a.device))
    job = OnlineJob(recipe, target, a.logs, state_dir=a.state, publish_dir=a.publish)
    results = job.run(once=a.once)
    if a.once:
        for r in results:
            print(json.dumps(r, default=str)[:4000])
    print(json.dumps(job.ledger.counts()))
    return 0
