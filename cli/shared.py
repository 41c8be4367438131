"""What subcommands share: the recipe named on the command line, with its overrides, and the target it
names, loaded (the stages, ``traces``); SuffixDecoding's options (``eval --suffix``, ``serve --suffix``)."""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.drafters.suffix import SuffixConfig
from draftsmith.recipe import Recipe, load_recipe
from draftsmith.target import Target, load_target


def recipe_from(args: argparse.Namespace) -> Recipe:
    """The recipe ``args.recipe`` with the dotted overrides ``args.overrides``."""
    return load_recipe(args.recipe, args.overrides)


def target_of(recipe: Recipe) -> Target:
    """The recipe's target on the GPU when there is one; says what it loaded and how long it took."""
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    t0 = time.time()
    target = load_target(recipe.target, device="cuda" if torch.cuda.is_available() else "cpu")
    print(f"target {target.name} ({target.fingerprint}) loaded in {time.time() - t0:.1f} s")
    return target


def add_suffix_args(ap: argparse.ArgumentParser, suffix_help: str) -> None:
    """``--suffix`` (help: ``suffix_help``) and SuffixDecoding's settings, read back by `suffix_config`."""
    ap.add_argument("--suffix", action="store_true", help=suffix_help)
    ap.add_argument("--suffix-depth", type=int, default=24, help="SuffixDecoding: longest match + draft")
    ap.add_argument("--suffix-spec-factor", type=float, default=1.0,
                    help="SuffixDecoding: draft at most match length x this many tokens")
    ap.add_argument("--suffix-min-prob", type=float, default=0.1, help="SuffixDecoding: stop under this probability")
    ap.add_argument("--suffix-min-score", type=float, default=2.0,
                    help="SuffixDecoding: draft only when the draft's expected accepted tokens reach this "
                         "(0: always draft, as the reference implementation; 2: measured best on a CPU)")
    ap.add_argument("--suffix-max-requests", type=int, default=10000,
                    help="SuffixDecoding: responses kept in the global index (FIFO; 0 = per-request index only)")


def suffix_config(args: argparse.Namespace) -> SuffixConfig:
    """The `SuffixConfig` of the options `add_suffix_args` added (a value out of range: pydantic's error)."""
    return SuffixConfig(max_depth=args.suffix_depth, max_spec_tokens=args.suffix_depth,
                        max_spec_factor=args.suffix_spec_factor, min_token_prob=args.suffix_min_prob,
                        max_cached_requests=args.suffix_max_requests, min_score=args.suffix_min_score)
