"""The package's folders as setup.py maps them (draftsmith.NAME = FOLDER/), for scripts that put draftsmith on the
path without an install (scripts/gpu_check.sh). Prints one ``NAME=FOLDER`` a line; ``--import`` instead imports
draftsmith, every subpackage and each CLI subcommand's module, failing with the first that does not import."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def folders() -> dict[str, str]:
    """setup.py's FOLDERS without running setup.py: {subpackage name: folder}, the root package left out."""
    m = re.search(r"^FOLDERS = (\{.*?\})\n", (ROOT / "setup.py").read_text(), re.S | re.M)
    if m is None:
        raise SystemExit("package_folders: no FOLDERS = {...} in setup.py")
    return {pkg.split(".", 1)[1]: folder for pkg, folder in ast.literal_eval(m.group(1)).items()
            if pkg != "draftsmith"}


def main(argv: list[str]) -> int:
    if argv == ["--import"]:
        root = Path(importlib.import_module("draftsmith").__file__).parent
        for sub in folders():
            mod = importlib.import_module(f"draftsmith.{sub}")
            # from the links beside draftsmith itself, not found elsewhere (an editable install's finder)
            if Path(mod.__file__).parent.parent != root:
                raise SystemExit(f"package_folders: draftsmith.{sub} comes from {mod.__file__}, not from {root}")
        for f in sorted((root / "cli").glob("*.py")):  # each subcommand's module (the CLI imports them lazily)
            if f.stem not in ("__init__", "__main__"):
                try:
                    importlib.import_module(f"draftsmith.cli.{f.stem}")
                except ModuleNotFoundError as e:  # a third-party extra (uvicorn for serve) may be absent there
                    if (e.name or "").split(".")[0] == "draftsmith":
                        raise
                    print(f"package_folders: draftsmith.cli.{f.stem} not checked: {e.name} is not installed",
                          file=sys.stderr)
        return 0
    print("\n".join(f"{sub}={folder}" for sub, folder in folders().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
