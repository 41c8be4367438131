"""What subcommands share: the recipe named on the command line, with its overrides, and the target it
names, loaded in its dtype (the stages, ``traces``); ``--dtype``; SuffixDecoding's options (``eval --suffix``,
``serve --suffix``)."""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.drafters.suffix import SuffixConfig
from draftsmith.recipe import Recipe, load_recipe
from draftsmith.target import Target, dtype_name, load_target, resolve_dtype

DTYPE_CHOICES = ("float32", "bfloat16", "float16", "auto")


def add_dtype_arg(ap: argparse.ArgumentParser, default: str | None, where: str) -> None:
    """``--dtype``: the dtype the target is loaded and decoded in (``where`` names the default)."""
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default=default,
                    help=f"the target's dtype (default: {where}); auto = bf16 on CUDA with bf16 else fp16, bf16 on a "
                         "CPU with native bf16 else float32. Decoding is lossless w.r.t. the target in this dtype; "
                         "the fingerprint does not depend on it")


def recipe_from(args: argparse.Namespace) -> Recipe:
    """The recipe ``args.recipe`` with the dotted overrides ``args.overrides`` (and ``--dtype``, which beats
    them)."""
    overrides = list(args.overrides or [])
    if getattr(args, "dtype", None):
        overrides.append(f"dtype={args.dtype}")
    return load_recipe(args.recipe, overrides)


def load_target_as(name: str, dtype: str | None, device) -> Target:
    """`load_target` in ``dtype`` (a recipe name, None = float32) on ``device``; prints what it chose and why
    when that is not plain float32."""
    choice = resolve_dtype(dtype, device)
    if choice.name != "float32" or (dtype or "float32") != "float32":
        print(f"target dtype {choice.name} ({choice.reason})")
    return load_target(name, dtype=choice.dtype, device=device)


def target_of(recipe: Recipe, dtype: str | None = None) -> Target:
    """The recipe's target on the GPU when there is one, in the recipe's dtype (or ``dtype``); says what it
    loaded and how long it took."""
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    t0 = time.time()
    target = load_target_as(recipe.target, dtype or recipe.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    print(f"target {target.name} ({target.fingerprint}, {dtype_name(target.dtype)}) loaded in "
          f"{time.time() - t0:.1f} s")
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
    ap.add_argument("--suffix-cost-aware", choices=("on", "off", "both"), default="off",
                    help="SuffixDecoding: cut each draft to its prefix with the most expected tokens per unit of "
                         "the verification time measured on this machine (both: the two side by side, the "
                         "cost-aware one as 'ours suffix (cost-aware)')")
    ap.add_argument("--suffix-max-requests", type=int, default=10000,
                    help="SuffixDecoding: responses kept in the global index (FIFO; 0 = per-request index only)")


def suffix_config(args: argparse.Namespace, both_ok: bool = False) -> SuffixConfig:
    """The `SuffixConfig` of the options `add_suffix_args` added (a value out of range: pydantic's error);
    ``--suffix-cost-aware both`` only where the command runs methods side by side (``both_ok``)."""
    if getattr(args, "suffix_cost_aware", "off") == "both" and not both_ok:
        raise ValueError("--suffix-cost-aware both compares the two side by side: only `draftsmith eval` does "
                         "that; here choose on or off")
    return SuffixConfig(max_depth=args.suffix_depth, max_spec_tokens=args.suffix_depth,
                        max_spec_factor=args.suffix_spec_factor, min_token_prob=args.suffix_min_prob,
                        max_cached_requests=args.suffix_max_requests, min_score=args.suffix_min_score,
                        cost_aware=getattr(args, "suffix_cost_aware", "off") == "on")

