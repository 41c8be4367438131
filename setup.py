"""Package layout: each top-level folder is a subpackage of `draftsmith` (core/ is `draftsmith` itself).

Subpackages are discovered by walking the folders, so a new kind is one new folder
(heads/NAME/, drafters/NAME/, classifiers/NAME/) with an __init__.py and nothing to list here.
Everything else (metadata, dependencies, entry points) is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = {"draftsmith": "core", "draftsmith.cli": "cli", "draftsmith.export": "export",
           "draftsmith.common": "common", "draftsmith.engine": "engine", "draftsmith.heads": "heads",
           "draftsmith.drafters": "drafters", "draftsmith.classifiers": "classifiers", "draftsmith.train": "train",
           "draftsmith.eval": "eval", "draftsmith.serve": "serve", "draftsmith.recipes": "recipes",
           "draftsmith.sim": "sim", "draftsmith.pipeline": "pipeline"}


def packages() -> tuple[list[str], dict[str, str]]:
    names, dirs = [], {}
    for pkg, folder in FOLDERS.items():
        inits = sorted(p.parent for p in (ROOT / folder).rglob("__init__.py"))
        if folder == "recipes":  # data folders: packages too, so setuptools ships them without a warning
            inits = [ROOT / folder,
                     *sorted(d for d in (ROOT / folder).iterdir() if d.is_dir() and d.name != "__pycache__")]
        for where in inits:
            if "__pycache__" in where.parts:
                continue
            rel = where.relative_to(ROOT / folder)
            name = ".".join([pkg, *rel.parts])
            names.append(name)
            dirs[name] = str(where.relative_to(ROOT))
    return names, dirs


PACKAGES, PACKAGE_DIR = packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR,
      package_data={"draftsmith.recipes": ["*.yaml"], "draftsmith.recipes.launch": ["*.yaml", "*.json"],
                    "draftsmith.recipes.trees": ["*.json"], "draftsmith.sim": ["profiles/*.yaml"],
                    "draftsmith.engine": ["csrc/*.cpp", "csrc/*.h"]},
      include_package_data=False)
