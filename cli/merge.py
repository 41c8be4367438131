"""``draftsmith merge OUT RUN...``: the data and caches of several finished data runs as one directory,
to train on with ``shared_data=OUT``."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.pipeline.stages import merge_runs


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary)
    sp.add_argument("out", help="new directory (then train with shared_data=OUT)")
    sp.add_argument("runs", nargs="+", help="run directories whose data and cache stages finished")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    m = merge_runs(Path(args.out), [Path(r) for r in args.runs])
    print(f"merged {len(args.runs)} runs -> {args.out}: {m['cache_sequences']} sequences, "
          f"{m['cache_tokens']} tokens ({m['sources']}); train with shared_data={args.out}")
    return 0
