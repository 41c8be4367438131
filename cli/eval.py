"""``draftsmith eval CHECKPOINT ...``: benchmark drafters with the lossless decoder.

The parser and the benchmark are draftsmith.eval.cli's (``python -m draftsmith.eval.cli`` runs it too):
``draftsmith eval`` hands it every argument after ``eval`` (see ``draftsmith eval -h``).
"""

from __future__ import annotations

import argparse

from draftsmith.eval.cli import eval_main


def add_parser(subparsers, name: str, summary: str) -> None:
    """Listed by ``draftsmith --help``; ``draftsmith.cli.main`` calls `main` with the arguments as given,
    because argparse's REMAINDER drops leading options (``draftsmith eval --plain CKPT``)."""
    sp = subparsers.add_parser(name, help=summary, add_help=False)
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return main(args.rest)


def main(argv: list[str]) -> int:
    eval_main(argv)  # returns the report (already written); the exit status is 0
    return 0
