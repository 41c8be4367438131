"""``draftsmith predictors TRACES``: the acceptance-length predictors (classifiers/: DISCO, SpecDec++)
trained and tuned on the traces ``draftsmith traces`` recorded, per temperature."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith import registry
from draftsmith.checkpoint import read_json
from draftsmith.target import load_target
from draftsmith.train.training.predictors import format_summary, train_predictors


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary)
    sp.add_argument("traces", help="a directory written by `draftsmith traces`")
    sp.add_argument("--kinds", nargs="+", choices=sorted(registry.predictors()), default=None,
                    help="length predictors to train (default: all)")
    sp.add_argument("--out", default=None, help="output directory (default: next to the traces, predictors/)")
    sp.add_argument("--max-len", type=int, default=8, help="the longest round the policies may draft")
    sp.add_argument("--epochs", type=int, default=20, help="SpecDec++ head epochs")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    meta = read_json(Path(args.traces) / "meta.json", "acceptance-trace meta", required=("target.name",))
    target = load_target(meta["target"]["name"])
    res = train_predictors(args.traces, target, kinds=args.kinds, out=args.out, max_len=args.max_len,
                           epochs=args.epochs)
    print(format_summary(res))
    return 0
