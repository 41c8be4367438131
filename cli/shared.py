"""What the recipe-driven subcommands (the stages, ``traces``) share: the recipe named on the command
line, with its overrides, and the target it names, loaded."""

from __future__ import annotations

import argparse
import time

import torch

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
