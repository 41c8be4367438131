"""``draftsmith traces RECIPE``: acceptance traces of a chain drafter on the recipe's training prompts
(the data ``draftsmith predictors`` trains on)."""

from __future__ import annotations

import argparse

from draftsmith.pipeline import stages as pipeline
from draftsmith.cli.shared import recipe_from, target_of


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary)
    sp.add_argument("recipe", help="recipe YAML path or built-in name")
    sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. threads=1")
    sp.add_argument("--checkpoint", default=None,
                    help="drafter checkpoint (default: the recipe's final), or first-layers:N / early-exit:L")
    sp.add_argument("--prompts", type=int, default=100, help="training prompts to decode (first user turns)")
    sp.add_argument("--max-new-tokens", type=int, default=128)
    sp.add_argument("--draft-len", type=int, default=8, help="fixed chain length while recording")
    sp.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    sp.add_argument("--calibration-every", type=int, default=5, help="every N-th prompt goes to the calibration split")
    sp.add_argument("--out", default=None, help="output directory (default: RUN/traces)")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe = recipe_from(args)
    res = pipeline.stage_traces(recipe, target_of(recipe), checkpoint=args.checkpoint, prompts=args.prompts,
                                max_new_tokens=args.max_new_tokens, draft_len=args.draft_len,
                                temperatures=args.temperature, out=args.out,
                                calibration_every=args.calibration_every)
    print(f"traces of {res['drafter']['name']} on {res['prompts']} training prompts: {res['summary']} "
          f"-> {res['out']}")
    return 0
