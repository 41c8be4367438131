"""The package's layering, read from every module's imports (AST), so it stays true.

Folders (each a subpackage of `draftsmith`, core/ being `draftsmith` itself) sit in layers; an import
may point down or sideways along an allowed arrow, never up:

    core, recipes  <-  engine  <-  common  <-  kinds (heads, drafters, classifiers)
        <-  train, serve, eval, sim  <-  export  <-  pipeline  <-  cli

Checked here, function-local imports included: no arrow against the layers, no import cycle between
modules, no private (underscore) name imported from another folder, no function-local import of a
draftsmith module without a comment naming why (an optional dependency or a real cycle), and no kind
name compared as a string (nor isinstance on a kind's class) outside the kind's own folder.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"core": "draftsmith", "recipes": "draftsmith.recipes", "engine": "draftsmith.engine",
           "common": "draftsmith.common", "heads": "draftsmith.heads", "drafters": "draftsmith.drafters",
           "classifiers": "draftsmith.classifiers", "train": "draftsmith.train", "serve": "draftsmith.serve",
           "eval": "draftsmith.eval", "export": "draftsmith.export", "cli": "draftsmith.cli",
           "sim": "draftsmith.sim", "pipeline": "draftsmith.pipeline"}
LAYER = {"core": 0, "recipes": 0, "engine": 1, "common": 2, "heads": 3, "drafters": 3, "classifiers": 3,
         "train": 4, "serve": 4, "eval": 4, "sim": 4, "export": 5, "pipeline": 6, "cli": 7}
#: arrows allowed between two folders of one layer (everything else sideways is an error)
SIDEWAYS = {("drafters", "heads"), ("eval", "train"), ("serve", "train")}
KIND_FAMILIES = ("heads", "drafters", "classifiers")
EXEMPT = {"draftsmith.__main__"}  # `python -m draftsmith` runs the CLI: the top, wherever its file sits


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mods[".".join((pkg, *rel))] = p
    return mods


MODULES = _modules()


def folder_of(mod: str) -> str:
    best = "core"
    for folder, pkg in FOLDERS.items():
        if (mod == pkg or mod.startswith(pkg + ".")) and len(pkg) > len(FOLDERS[best]):
            best = folder
    return best


def kind_of(mod: str) -> str | None:
    """``heads.medusa`` for a module inside a kind's folder, else None."""
    parts = mod.split(".")
    if len(parts) >= 3 and parts[1] in KIND_FAMILIES and f"draftsmith.{parts[1]}.{parts[2]}" in MODULES \
            and MODULES[f"draftsmith.{parts[1]}.{parts[2]}"].name == "__init__.py":
        return f"{parts[1]}.{parts[2]}"
    return None


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


class Import:
    def __init__(self, src: str, target: str, names: list[str], local: bool, line: int, comment: bool):
        self.src, self.target, self.names, self.local, self.line, self.comment = (
            src, target, names, local, line, comment)


def _imports() -> list[Import]:
    out = []
    for mod, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        is_pkg = path.name == "__init__.py"

        def visit(node, local: bool):
            for ch in ast.iter_child_nodes(node):
                if isinstance(ch, ast.If) and getattr(ch.test, "id", None) == "TYPE_CHECKING":
                    continue  # annotations only: never imported at run time
                loc = local or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(ch, ast.Import):
                    for a in ch.names:
                        if a.name.startswith("draftsmith"):
                            t = _resolve(a.name)
                            if t:
                                out.append(Import(mod, t, [], loc, ch.lineno, "#" in lines[ch.lineno - 1]))
                elif isinstance(ch, ast.ImportFrom):
                    if ch.level:
                        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                        base = base[:len(base) - (ch.level - 1)]
                        src = ".".join(base + ([ch.module] if ch.module else []))
                    else:
                        src = ch.module or ""
                    if src.startswith("draftsmith"):
                        comment = any("#" in lines[i - 1] for i in range(ch.lineno, (ch.end_lineno or ch.lineno) + 1))
                        for a in ch.names:
                            t = _resolve(f"{src}.{a.name}") if f"{src}.{a.name}" in MODULES else _resolve(src)
                            if t:
                                names = [] if f"{src}.{a.name}" in MODULES else [a.name]
                                out.append(Import(mod, t, names, loc, ch.lineno, comment))
                visit(ch, loc)
        visit(ast.parse(text), False)
    return out


IMPORTS = _imports()


def folder_table() -> dict[tuple[str, str], int]:
    """How many imports point from each folder to each other folder."""
    tab: dict[tuple[str, str], int] = defaultdict(int)
    for i in IMPORTS:
        a, b = folder_of(i.src), folder_of(i.target)
        if a != b and i.src not in EXEMPT:
            tab[(a, b)] += 1
    return dict(tab)


def test_no_arrow_against_the_layers():
    bad = []
    for i in IMPORTS:
        if i.src in EXEMPT:
            continue
        a, b = folder_of(i.src), folder_of(i.target)
        if a == b:
            continue
        if LAYER[b] > LAYER[a] or (LAYER[b] == LAYER[a] and (a, b) not in SIDEWAYS):
            bad.append(f"{MODULES[i.src].relative_to(ROOT)}:{i.line}: {a} -> {b} ({i.target})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = defaultdict(set)
    for i in IMPORTS:
        if i.target != i.src:
            graph[i.src].add(i.target)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strong(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(MODULES):
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_folders():
    bad = [f"{MODULES[i.src].relative_to(ROOT)}:{i.line}: {n} from {i.target}"
           for i in IMPORTS for n in i.names
           if n.startswith("_") and not n.startswith("__") and folder_of(i.src) != folder_of(i.target)]
    assert not bad, "private names imported from another folder:\n" + "\n".join(bad)


def test_function_local_imports_say_why():
    bad = [f"{MODULES[i.src].relative_to(ROOT)}:{i.line}: {i.target}" for i in IMPORTS if i.local and not i.comment]
    assert not bad, ("function-local imports of draftsmith modules without a comment naming the optional "
                     "dependency or cycle:\n" + "\n".join(bad))


def _kind_names() -> dict[str, str]:
    """Registered kind names (drafter kinds and length predictors) -> their folder (``heads.medusa``)."""
    from draftsmith import registry

    out = {}
    for name in registry.kinds():
        out[name] = kind_of(registry.get(name).__module__)
    for name, fit in registry.predictors().items():
        out[name] = kind_of(fit.__module__)
    return out


def _kind_classes() -> dict[str, str]:
    """Class names defined in a kind's folder -> that folder."""
    out = {}
    for mod, path in MODULES.items():
        k = kind_of(mod)
        if k:
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    out[node.name] = k
    return out


def test_no_kind_branches_outside_the_kinds_folder():
    names, classes = _kind_names(), _kind_classes()
    assert {"medusa", "hydra", "kangaroo", "standalone", "own-tokenizer", "disco", "specdec"} <= set(names)
    bad = []
    for mod, path in MODULES.items():
        here = kind_of(mod)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for c in [node.left, *node.comparators]:
                    consts = [c] if isinstance(c, ast.Constant) else list(getattr(c, "elts", []))
                    for k in consts:
                        if isinstance(k, ast.Constant) and k.value in names and names[k.value] != here:
                            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: compares with kind name {k.value!r}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                arg = node.args[1]
                for el in getattr(arg, "elts", [arg]):
                    name = getattr(el, "id", None) or getattr(el, "attr", None)
                    if name in classes and classes[name] != here:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: isinstance on {classes[name]}'s {name}")
    assert not bad, "kind-specific branches outside the kind's folder:\n" + "\n".join(bad)


def test_the_checks_can_fail():
    """Each rule flags a module written to break it (the checks are not vacuous)."""
    global MODULES, IMPORTS
    probe = ROOT / "engine" / "_layering_probe.py"
    assert not probe.exists()
    probe.write_text("from draftsmith.cli import main\nfrom draftsmith.common.chunks import _x\n\n\n"
                     "def f(k):\n    from draftsmith.heads.medusa.model import MedusaHeads\n"
                     "    return k == 'medusa' or isinstance(k, MedusaHeads)\n")
    try:
        MODULES = _modules()
        IMPORTS = _imports()
        for check in (test_no_arrow_against_the_layers, test_no_private_names_across_folders,
                      test_function_local_imports_say_why, test_no_kind_branches_outside_the_kinds_folder):
            with pytest.raises(AssertionError, match="_layering_probe"):
                check()
    finally:
        probe.unlink()
        MODULES = _modules()
        IMPORTS = _imports()


if __name__ == "__main__":  # the folder-level import table (imported names), for the docs
    for (a, b), n in sorted(folder_table().items(), key=lambda kv: (LAYER[kv[0][0]], kv[0])):
        print(f"{a:12s} -> {b:12s} {n}")
    local = [i for i in IMPORTS if i.local]
    print(f"{len(MODULES)} modules; function-local imports of draftsmith modules: {len(local)} names, each with a "
          f"comment: {all(i.comment for i in local)}")
