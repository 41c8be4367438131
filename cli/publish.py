"""``draftsmith publish``: put a trained drafter behind ``draftsmith serve`` (versioned, atomic, reversible).

    draftsmith publish CKPT --to DIR [--tree SPEC] [--keep 5] [--target NAME|DIR] [--prompts 2] [--tokens 32]
    draftsmith publish list --to DIR
    draftsmith publish rollback [VERSION] --to DIR

Before a checkpoint becomes current it is checked against the target: it loads
(manifest, weights, the target's fingerprint), the decoder accepts it with
``--tree`` (depth, vocabulary, tree support), and greedy decoding of a few
MT-Bench prompts with it equals plain greedy decoding (a divergence at a
near-tie of the target's top two logits, below 1e-3, is allowed and reported).
Only then is it copied in as a new version and ``current`` switched
(`draftsmith.publish.PublishStore`); a running ``draftsmith serve --publish DIR``
picks it up before its next request or batch. ``rollback`` switches ``current``
back to the previous kept version (or VERSION); ``list`` shows the versions,
the current one and the history of switches.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from draftsmith.checkpoint import drafter_from_checkpoint, read_manifest
from draftsmith.engine.capabilities import capabilities
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.tree_build import parse_tree
from draftsmith.eval.greedy_equality import first_divergence, tie_threshold, top2
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.publish import PublishError, PublishStore
from draftsmith.target import load_target

TIE_GAP = 1e-3


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary, description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("what", help="a checkpoint directory, or `list`, or `rollback`")
    sp.add_argument("version", nargs="?", default=None, help="rollback: the version to switch to (default: previous)")
    sp.add_argument("--to", required=True, help="publish directory (what `draftsmith serve --publish` reads)")
    sp.add_argument("--tree", default="chain", help="the tree the server will use (as `serve --tree`), checked here")
    sp.add_argument("--keep", type=int, default=5, help="versions kept (older ones are deleted)")
    sp.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's)")
    sp.add_argument("--prompts", type=int, default=2, help="MT-Bench prompts decoded by the greedy check")
    sp.add_argument("--tokens", type=int, default=32, help="new tokens per prompt in the greedy check")
    sp.set_defaults(func=run)


def _target_for(ckpt: Path, name: str | None):
    if name:
        return load_target(name)
    t = read_manifest(ckpt)["target"]
    return load_target(t["path"] if t.get("path") and Path(t["path"]).exists() else t["name"])


def check_checkpoint(ckpt: Path, target, tree: str = "chain", prompts: int = 2, tokens: int = 32) -> dict:
    """Load ``ckpt`` for ``target`` and decode greedily with it; ValueError naming what is wrong."""
    drafter = drafter_from_checkpoint(ckpt, target)  # manifest, weights, fingerprint
    shape = parse_tree(tree, ckpt) if capabilities(drafter).supports_trees else None
    if shape is None and tree != "chain":
        raise ValueError(f"{ckpt}: this drafter drafts chains only, but --tree {tree!r} was given")
    dec = SpeculativeDecoder(target, drafter, tree=shape)
    plain = SpeculativeDecoder(target)
    out = {"prompts": prompts, "tokens": tokens, "tree": tree, "equal": 0, "near_ties": [], "accepted": 0,
           "forwards": 0}
    t0 = time.perf_counter()
    for p in mtbench_prompts(target.tokenizer, prompts, spread=True):
        ref = plain.generate(p.ids, tokens).tokens
        res = dec.generate(p.ids, tokens)
        out["accepted"] += sum(s.accepted for s in res.steps)
        out["forwards"] += len(res.steps)
        d = first_divergence(ref, res.tokens)
        if d is None:
            out["equal"] += 1
            continue
        gap, top1 = top2(target, p.ids + ref[:d])
        if gap >= tie_threshold(top1, target.dtype, TIE_GAP):  # TIE_GAP in fp32, a few ulps in bf16/fp16
            raise ValueError(f"{ckpt}: greedy decoding with this drafter differs from plain greedy decoding on "
                             f"MT-Bench question {p.question_id} at token {d} (top-2 gap {gap:.4f}, not a tie): "
                             f"not published")
        out["near_ties"].append({"question": p.question_id, "at": d, "gap": gap})
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def run(args: argparse.Namespace) -> int:
    store = PublishStore(args.to)
    if args.what == "list":
        cur = store.current()
        print(f"{args.to}: current {cur or 'none'}")
        for v in store.versions():
            info = json.loads((store.path(v) / "manifest.json").read_text()).get("kind", "?")
            print(f"  {'*' if v == cur else ' '} {v}  {info}")
        for h in store.history()[-10:]:
            print(f"    {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(h['time']))} {h.get('event')} "
                  f"{h['version']}" + (f" (from {h['from']})" if h.get("from") else "")
                  + (f" <- {h['source']}" if h.get("source") else ""))
        return 0
    if args.what == "rollback":
        v = store.rollback(args.version)
        print(f"{args.to}: current is now {v}")
        return 0
    if args.version is not None:
        raise PublishError(f"unexpected argument {args.version!r} (publish takes one checkpoint)")
    ckpt = Path(args.what)
    if not (ckpt / "manifest.json").exists():
        raise PublishError(f"{ckpt} is not a drafter checkpoint (no manifest.json); "
                           f"`draftsmith publish list|rollback --to DIR` manage a publish directory")
    target = _target_for(ckpt, args.target)
    checked = check_checkpoint(ckpt, target, args.tree, args.prompts, args.tokens)
    print(f"checked {ckpt} against {target.name} ({target.fingerprint}): greedy equal on {checked['equal']}/"
          f"{checked['prompts']} prompts ({len(checked['near_ties'])} near-ties), {checked['accepted']} draft tokens "
          f"accepted in {checked['forwards']} target forwards", flush=True)
    v = store.publish(ckpt, keep=args.keep, info={"source": str(ckpt.resolve()), "tree": args.tree,
                                                   "check": checked})
    print(f"published {ckpt} as {v} in {args.to} (current); serve it with "
          f"`draftsmith serve --publish {args.to} --tree {args.tree}`")
    return 0
