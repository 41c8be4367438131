"""``draftsmith export CKPT --to FMT --out DIR`` (a drafter in a layout serving engines load, checked by
reload) and ``draftsmith import SRC --out CKPT`` (a vLLM-Medusa or original-Medusa directory -> a
draftsmith checkpoint)."""

from __future__ import annotations

import argparse

from draftsmith.export import FORMATS, export, import_drafter, import_target, source_target
from draftsmith.target import load_target


def add_parser(subparsers, name: str, summary: str) -> None:
    """``name`` is ``export`` or ``import``."""
    sp = subparsers.add_parser(name, help=summary)
    if name == "import":
        sp.add_argument("source", help="directory with config.json and model.safetensors or medusa_lm_head.safetensors")
        sp.add_argument("--out", required=True, help="new checkpoint directory")
        sp.add_argument("--target", default=None,
                        help="target name or directory (default: its base_model_name_or_path if local, "
                             "else the default)")
        sp.set_defaults(func=run_import)
        return
    sp.add_argument("source", help="checkpoint directory, or first-layers:N (the untrained baseline, --to hf)")
    sp.add_argument("--to", required=True, choices=list(FORMATS), help="export format")
    sp.add_argument("--out", required=True, help="new output directory")
    sp.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's)")
    sp.add_argument("--base-model", default=None,
                    help="what engines load as the target (default: the target's directory)")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``draftsmith export``."""
    target = load_target(source_target(args.source, args.target))
    out = export(args.source, args.to, args.out, target, base_model=args.base_model)
    print(f"exported {args.source} as {args.to} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))}); "
          f"loaded back and checked")
    return 0


def run_import(args: argparse.Namespace) -> int:
    """``draftsmith import``."""
    target = load_target(import_target(args.source, args.target))
    out = import_drafter(args.source, args.out, target)
    print(f"imported {args.source} -> checkpoint {out} for target {target.name} ({target.fingerprint})")
    return 0
