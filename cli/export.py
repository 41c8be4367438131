"""``draftsmith export CKPT --to FMT --out DIR`` (a drafter in a layout serving engines load, checked by
reload) and ``draftsmith import SRC --out CKPT`` (a vLLM-Medusa or original-Medusa directory -> a
draftsmith checkpoint)."""

from __future__ import annotations

import argparse

from pathlib import Path

from draftsmith.export import FORMATS, export, import_drafter, import_target, source_target
from draftsmith.export.llamacpp import GGUF_TYPES, LlamaCppError, export_gguf
from draftsmith.target import DEFAULT_TARGET, load_target


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
    sp.add_argument("source", help="checkpoint directory, first-layers:N (the untrained baseline, --to hf or gguf), "
                    "or `target` (the target itself, --to gguf)")
    sp.add_argument("--to", required=True, choices=[*FORMATS, "gguf"],
                    help="export format (gguf: llama.cpp; needs `bash scripts/llamacpp_env.sh`)")
    sp.add_argument("--gguf-type", default="f32", choices=GGUF_TYPES,
                    help="GGUF weight type (--to gguf): f32, f16, bf16, q8_0 from llama.cpp's converter, the "
                         "4-/5-/6-bit types from llama-quantize (default: f32)")
    sp.add_argument("--target-gguf", default=None,
                    help="the target GGUF llama.cpp reloads a drafter against (default: the target converted to the "
                         "same type; for the default target's 4-bit types, the Q4_1 file its package ships)")
    sp.add_argument("--out", required=True, help="new output directory")
    sp.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's)")
    sp.add_argument("--base-model", default=None,
                    help="what engines load as the target (default: the target's directory)")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``draftsmith export``."""
    if args.to == "gguf" or args.source == "target":
        if args.to != "gguf":
            raise SystemExit("`draftsmith export target` writes the target itself: only --to gguf")
        target = load_target(args.target or DEFAULT_TARGET if args.source == "target"
                             else source_target(args.source, args.target))
        try:
            rep = export_gguf(args.source, args.out, target, args.gguf_type, target_file=args.target_gguf)
        except LlamaCppError as e:
            raise SystemExit(f"draftsmith export --to gguf: {e}") from None
        reload = rep.get("reload")
        print(f"exported {args.source} as GGUF {rep['gguf_type']} -> {args.out}/{rep['file']} "
              f"({rep['bytes'] / 1e6:.1f} MB)" + (f"; reloaded by llama.cpp against {Path(rep['target_file']).name}: "
                                                   f"drafted {reload['n_drafted']}, accepted {reload['n_accept']}"
                                                   if reload else ""))
        return 0
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
