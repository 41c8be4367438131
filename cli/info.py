"""``draftsmith info PATH``: describe a checkpoint, cache, data directory or recipe."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.checkpoint import read_json, read_manifest
from draftsmith.recipe import load_recipe


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary)
    sp.add_argument("path")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    p = Path(args.path)
    for name in ("manifest.json", "index.json", "meta.json"):
        if (p / name).exists():  # a malformed file is an error naming it (CheckpointError, exit 2)
            obj = read_manifest(p) if name == "manifest.json" else read_json(p / name, name)
            print(json.dumps(obj, indent=2)[:20000])
            return 0
    if p.suffix in (".yaml", ".yml") or not p.exists():
        print(json.dumps(load_recipe(p).model_dump(mode="json"), indent=2))
        return 0
    print(f"{p}: not a draftsmith checkpoint, cache, data directory or recipe", file=sys.stderr)
    return 2
