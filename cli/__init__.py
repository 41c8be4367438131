"""The ``draftsmith`` command line: one subcommand per stage.

  draftsmith data RECIPE [key=value ...]     prompts -> target-regenerated responses
  draftsmith cache RECIPE [...]              one target pass; stores what the drafter needs
  draftsmith train RECIPE [...]              train the drafter (also under `accelerate launch`)
  draftsmith report RECIPE [...]             held-out head accuracy of the final checkpoint
  draftsmith run RECIPE [...]                all of the above, in order
  draftsmith quickstart [...]                `run quickstart` on the default target
  draftsmith info PATH                       describe a checkpoint, cache or recipe
  draftsmith targets [install NAME]          named targets: known, installed, converted
  draftsmith eval CHECKPOINT [...]           decode MT-Bench with the lossless decoder
  draftsmith bench suite CKPT... [--quick]   the evaluation protocol: MT-Bench 1st/2nd turns, HumanEval, T=0/1
  draftsmith export CKPT --to FMT --out DIR  vllm-eagle3 | eagle3 | vllm-dflash | vllm-medusa | hf | draftsmith | gguf
  draftsmith import SRC --out CKPT           an engine-layout dir (EAGLE-3, DFlash, Medusa) -> checkpoint
  draftsmith traces RECIPE [--checkpoint C]  acceptance traces of a chain drafter on training prompts
  draftsmith predictors TRACES               DISCO and SpecDec++ trained and tuned on those traces
  draftsmith simulate calibrate|record|run|replay|dsi  cost-model simulator (measured or published profiles)
  draftsmith serve [--publish DIR --logs DIR] OpenAI-compatible server, lossless decoding, logs traffic
  draftsmith publish CKPT --to DIR           check a drafter against its target, make it current (list|rollback)
  draftsmith online RECIPE --logs DIR        continual distillation from the logs (rollback|status|import)

Under accelerate: ``accelerate launch --config_file recipes/launch/cpu_ddp2.yaml -m draftsmith.cli train RECIPE``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Collection
from types import ModuleType

# One module of draftsmith.cli per subcommand, or per group of closely related ones (stages: the recipe
# stages, run and quickstart; export: export and import). Each has add_parser(subparsers, name, summary),
# which registers the subcommand `name` with its arguments and set_defaults(func=...), and run(args), which
# returns the exit status; the modules that parse their own arguments have main(argv) instead or as well.

#: Every subcommand `draftsmith --help` lists, in its order: name -> (its module, one-line summary).
#: Only the module of the subcommand being run is imported: they import torch, transformers, the training
#: and decoding code, which `draftsmith --help` and the error for a mistyped subcommand do not need.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "data": ("stages", "data stage"),
    "cache": ("stages", "cache stage"),
    "train": ("stages", "train stage"),
    "trees": ("stages", "trees stage"),
    "report": ("stages", "report stage"),
    "bench": ("stages", "bench stage (`draftsmith bench suite -h`: the evaluation protocol over prompt sets)"),
    "run": ("stages", "every stage in order"),
    "quickstart": ("stages", "the main job: run the quickstart recipe on the default target"),
    "info": ("info", "describe a checkpoint, cache, data dir or recipe"),
    "targets": ("targets", "the named targets and what of each is installed and converted (install NAME)"),
    "eval": ("eval", "evaluate with the lossless decoder (see `draftsmith eval -h`)"),
    "export": ("export", "export a drafter to a layout serving engines load (checked by reload)"),
    "traces": ("traces", "record acceptance traces of a chain drafter on the recipe's training prompts"),
    "predictors": ("predictors", "train DISCO and SpecDec++ on acceptance traces (per temperature)"),
    "simulate": ("simulate", "simulate decoding from traces and a cost profile: calibrate, record, run, replay, dsi"),
    "merge": ("merge", "data + caches of several finished data runs as one directory (for shared_data)"),
    "publish": ("publish", "check a drafter checkpoint and make it current in a publish directory (list|rollback)"),
    "import": ("export", "an engine-layout directory (EAGLE-3: speculators or EAGLE; Medusa: vLLM or TGI) -> "
                         "draftsmith checkpoint"),
}

#: Subcommands that parse their own arguments: name -> module whose main(argv) gets every argument after
#: the name. eval: argparse's REMAINDER would drop leading options (`draftsmith eval --plain CKPT`);
#: online: it has subcommands of its own (rollback, status, import) beside the job. serve and online are
#: not in SUBCOMMANDS (the description above names them).
OWN_ARGUMENTS: dict[str, str] = {"eval": "eval", "serve": "serve", "online": "online"}


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``draftsmith`` parser. The subcommands in ``commands`` (default: all) get their arguments,
    which imports their modules; the others are only listed, by name and summary."""
    ap = argparse.ArgumentParser(prog="draftsmith", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (module, summary) in SUBCOMMANDS.items():
        if commands is None or name in commands:
            _module(module).add_parser(sub, name, summary)
        else:
            sub.add_parser(name, help=summary)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "accelerate", "DeepSpeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:2] == ["bench", "suite"]:  # the suite (a recipe file called suite: give its path to `bench`)
            return _module("suite").main(argv[2:])
        if argv[:1] and argv[0] in OWN_ARGUMENTS:
            return _module(OWN_ARGUMENTS[argv[0]]).main(argv[1:])
        # the subcommand argparse will pick: the first argument that names one (only -h can come before it)
        args = build_parser([a for a in argv if a in SUBCOMMANDS][:1]).parse_args(argv)
        return args.func(args)
    # RecipeError, TargetMismatchError and CheckpointError are ValueErrors
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
