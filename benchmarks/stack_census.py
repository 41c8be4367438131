"""How many times the generation stack solves the same problem (caches, samplers, loops, compiled steps, probes).

Reads source text only (``ast`` and ``git``; it imports neither torch nor draftsmith), per revision:

    python -m benchmarks.stack_census                                  # the working tree
    python -m benchmarks.stack_census --rev 977f1a1 --rev WORKTREE --out runs/census/stack.json

``--rev`` is repeatable; ``WORKTREE`` names the working tree (tracked and untracked files that git does not
ignore, as they are on disk); any other value is a git revision, read with ``git ls-tree -r --name-only REV``
and ``git cat-file --batch`` (the text of ``git show REV:path``). Default: the working tree only.

Which files. The package folders are the values of ``FOLDERS`` in that revision's setup.py (read with
``ast``, never run), less tests/, benchmarks/, scripts/ and docs/; every ``.py`` file under them is counted,
at any depth, except under ``__pycache__``. A file's folder is its first path component.

What is counted (each list entry carries its file; names match case-sensitively):

1. ``lines``: non-blank lines (a line with anything but whitespace) of the ``.py`` files; ``modules``: the
   number of ``.py`` files; per folder and in total. A file that fails to parse still counts here.
2. ``kv_caches``: class definitions (at any nesting) whose name ends in ``Cache`` or ``KV``, except
   ``HiddenCache`` (the training cache of hidden states, not a KV cache).
3. ``samplers``: function definitions (``def`` or ``async def``) named ``inverse_cdf``, ``inverse_cdf_rows``,
   ``pick_tokens``, ``categorical`` or starting with ``sample``, at module level or in a class body (methods,
   also of nested classes); functions nested inside functions are not counted; ``sample_anchors`` (it draws training
   anchors, not tokens) is not a sampler.
4. ``generation_loops``: class definitions (at any nesting) whose name ends in ``Decoder`` or ``Generator``,
   plus module-level functions whose name starts with ``generate``.
5. ``compiled_steps``: calls ``torch.compile(...)``, i.e. an ``ast.Call`` whose func is the attribute
   ``compile`` of the plain name ``torch`` (``from torch import compile`` or an alias is not counted);
   listed as ``file:line``.
6. ``probes``: calls of the builtins ``getattr(...)`` and ``hasattr(...)`` (an ``ast.Call`` whose func is the
   plain name) in files outside the kinds' folders (heads/, drafters/, classifiers/); the total, per folder,
   per builtin, and ``distinct_names``: the number of distinct string literals passed as the second
   argument (a probe whose name is not a string literal counts in ``non_literal``).

7. ``config_dicts``: hand-built drafter configs: assignments ``self.config = ...`` whose value is a dict display,
   a dict comprehension or a ``dict(...)`` call, in the kinds' folders (a kind whose config is its pydantic
   class assigns that instead); listed as ``file:line``.

8. ``attention_layers``: definitions of an attention layer's query projection: assignments ``self.q = ...`` or
   ``self.q_proj = ...`` whose value is a call of ``nn.Linear`` (or ``torch.nn.Linear``), anywhere in the package;
   listed as ``file:line``. One per place a decoder layer is written out.

A file that fails to parse (``SyntaxError``, ``ValueError``) is counted in ``skipped`` with its error and
contributes nothing to counts 2-8.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

WORKTREE = "WORKTREE"
EXCLUDED = ("tests", "benchmarks", "scripts", "docs")
KIND_FOLDERS = ("heads", "drafters", "classifiers")
SAMPLER_NAMES = ("inverse_cdf", "inverse_cdf_rows", "pick_tokens", "categorical")
SAMPLER_PREFIX = "sample"
CACHE_SUFFIXES = ("Cache", "KV")
NOT_KV_CACHES = ("HiddenCache",)
NOT_SAMPLERS = ("sample_anchors",)
LOOP_CLASS_SUFFIXES = ("Decoder", "Generator")
LOOP_FUNCTION_PREFIX = "generate"
PROBES = ("getattr", "hasattr")


# ---- reading a revision -------------------------------------------------------------------------------------

def git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, check=True).stdout


def read_revision(repo: Path, rev: str) -> dict[str, str]:
    """Every .py file of ``rev`` (or of the working tree; setup.py among them) mapped to its text."""
    if rev == WORKTREE:
        names = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").decode().split("\0")
        out = {}
        for name in filter(None, names):
            path = repo / name
            if name.endswith(".py") and path.is_file():
                out[name] = path.read_text(encoding="utf-8", errors="replace")
        return out
    names = [n for n in git(repo, "ls-tree", "-r", "--name-only", "-z", rev).decode().split("\0") if n.endswith(".py")]
    blob = git(repo, "cat-file", "--batch", stdin="".join(f"{rev}:{n}\n" for n in names).encode())
    out, pos = {}, 0
    for name in names:  # each answer: "<sha> <type> <size>\n<content>\n" (or "<obj> missing\n")
        end = blob.index(b"\n", pos)
        header = blob[pos:end].split()
        if header[-1] == b"missing":
            pos = end + 1
            continue
        size = int(header[2])
        out[name] = blob[end + 1:end + 1 + size].decode("utf-8", errors="replace")
        pos = end + 1 + size + 1
    return out


def package_folders(setup_source: str) -> list[str]:
    """The values of the ``FOLDERS = {...}`` literal in setup.py, less the excluded folders, in order."""
    for node in ast.walk(ast.parse(setup_source)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets):
            folders = ast.literal_eval(node.value)
            return [f for f in dict.fromkeys(folders.values()) if f not in EXCLUDED]
    raise ValueError("setup.py has no FOLDERS = {...} assignment")


# ---- counting one file --------------------------------------------------------------------------------------

@dataclass
class FileCensus:
    caches: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    loops: list[str] = field(default_factory=list)
    compiles: list[int] = field(default_factory=list)
    probes: Counter = field(default_factory=Counter)  # builtin name -> calls
    probe_names: Counter = field(default_factory=Counter)  # string-literal attribute name -> calls
    non_literal: int = 0
    config_dicts: list[int] = field(default_factory=list)  # lines of ``self.config = {...}``
    attention: list[int] = field(default_factory=list)  # lines of ``self.q = nn.Linear(...)``


def _is_dict_value(v: ast.expr) -> bool:
    return (isinstance(v, (ast.Dict, ast.DictComp))
            or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict"))


def _is_linear_call(v: ast.expr) -> bool:
    f = v.func if isinstance(v, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "Linear" and (
        (isinstance(f.value, ast.Name) and f.value.id == "nn")
        or (isinstance(f.value, ast.Attribute) and f.value.attr == "nn"))


def nonblank_lines(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip())


def _defs_in_body(body: list[ast.stmt], prefix: str = ""):
    """(qualified name, def) for functions at this level and in class bodies below it (not inside functions)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _defs_in_body(node.body, f"{prefix}{node.name}.")


def is_sampler(name: str) -> bool:
    return (name in SAMPLER_NAMES or name.startswith(SAMPLER_PREFIX)) and name not in NOT_SAMPLERS


def census_source(source: str) -> FileCensus:
    """Counts 2-8 of the module docstring for one file's text; raises SyntaxError/ValueError if it does not parse."""
    tree = ast.parse(source)
    out = FileCensus()
    for qual, node in _defs_in_body(tree.body):
        if is_sampler(node.name):
            out.samplers.append(qual)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(LOOP_FUNCTION_PREFIX):
            out.loops.append(node.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            if node.name.endswith(CACHE_SUFFIXES) and node.name not in NOT_KV_CACHES:
                out.caches.append(node.name)
            if node.name.endswith(LOOP_CLASS_SUFFIXES):
                out.loops.append(node.name)
        elif isinstance(node, ast.Assign) and _is_dict_value(node.value) and any(
                isinstance(t, ast.Attribute) and t.attr == "config" and isinstance(t.value, ast.Name)
                and t.value.id == "self" for t in node.targets):
            out.config_dicts.append(node.lineno)
        elif isinstance(node, ast.Assign) and _is_linear_call(node.value) and any(
                isinstance(t, ast.Attribute) and t.attr in ("q", "q_proj") and isinstance(t.value, ast.Name)
                and t.value.id == "self" for t in node.targets):
            out.attention.append(node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "compile"
                    and isinstance(func.value, ast.Name) and func.value.id == "torch"):
                out.compiles.append(node.lineno)
            elif isinstance(func, ast.Name) and func.id in PROBES:
                out.probes[func.id] += 1
                arg = node.args[1] if len(node.args) > 1 else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.probe_names[arg.value] += 1
                else:
                    out.non_literal += 1
    out.compiles.sort()
    return out


# ---- one revision -------------------------------------------------------------------------------------------

def census(files: dict[str, str]) -> dict:
    """The census of one revision, given its files (path -> text; must include setup.py)."""
    folders = package_folders(files["setup.py"])
    per_folder = {f: {"lines": 0, "modules": 0} for f in folders}
    caches, samplers, loops, compiles, skipped, config_dicts, attention = [], [], [], [], [], [], []
    probe_folder: Counter = Counter()
    probe_kind: Counter = Counter()
    probe_names: Counter = Counter()
    non_literal = 0
    for path in sorted(files):
        parts = path.split("/")
        folder = parts[0]
        if folder not in per_folder or len(parts) < 2 or "__pycache__" in parts or not path.endswith(".py"):
            continue
        source = files[path]
        per_folder[folder]["lines"] += nonblank_lines(source)
        per_folder[folder]["modules"] += 1
        try:
            fc = census_source(source)
        except (SyntaxError, ValueError) as e:
            skipped.append({"file": path, "error": f"{type(e).__name__}: {e}"})
            continue
        caches += [{"name": n, "file": path} for n in fc.caches]
        samplers += [{"name": n, "file": path} for n in fc.samplers]
        loops += [{"name": n, "file": path} for n in fc.loops]
        compiles += [f"{path}:{line}" for line in fc.compiles]
        attention += [f"{path}:{line}" for line in fc.attention]
        if folder in KIND_FOLDERS:
            config_dicts += [f"{path}:{line}" for line in fc.config_dicts]
        if folder not in KIND_FOLDERS:
            probe_folder[folder] += sum(fc.probes.values())
            probe_kind.update(fc.probes)
            probe_names.update(fc.probe_names)
            non_literal += fc.non_literal
    totals = {"lines": sum(v["lines"] for v in per_folder.values()),
              "modules": sum(v["modules"] for v in per_folder.values())}
    return {
        "folders": per_folder, "totals": totals,
        "kv_caches": caches, "samplers": samplers, "generation_loops": loops, "compiled_steps": compiles,
        "probes": {"total": sum(probe_folder.values()),
                   "per_folder": {f: probe_folder[f] for f in folders if f not in KIND_FOLDERS},
                   "per_builtin": {b: probe_kind[b] for b in PROBES},
                   "distinct_names": len(probe_names), "non_literal": non_literal,
                   "names": dict(sorted(probe_names.items()))},
        "config_dicts": config_dicts, "attention_layers": attention,
        "skipped": skipped,
    }


def census_revision(repo: Path, rev: str) -> dict:
    sha = None if rev == WORKTREE else git(repo, "rev-parse", "--short", f"{rev}^{{commit}}").decode().strip()
    return {"rev": rev, "sha": sha, **census(read_revision(repo, rev))}


# ---- report -------------------------------------------------------------------------------------------------

def _label(r: dict) -> str:
    return r["rev"] if r["sha"] is None or r["sha"].startswith(r["rev"]) else f"{r['rev']} ({r['sha']})"


def table(results: list[dict]) -> str:
    folders = list(dict.fromkeys(f for r in results for f in r["folders"]))
    probe_folders = [f for f in folders if f not in KIND_FOLDERS]
    rows: list[tuple[str, list]] = []
    for f in folders:
        rows.append((f"lines {f}/", [r["folders"].get(f, {}).get("lines", "-") for r in results]))
    rows.append(("**lines total**", [r["totals"]["lines"] for r in results]))
    for f in folders:
        rows.append((f"modules {f}/", [r["folders"].get(f, {}).get("modules", "-") for r in results]))
    rows.append(("**modules total**", [r["totals"]["modules"] for r in results]))
    rows.append(("**KV caches**", [len(r["kv_caches"]) for r in results]))
    rows.append(("**samplers**", [len(r["samplers"]) for r in results]))
    rows.append(("**generation loops**", [len(r["generation_loops"]) for r in results]))
    rows.append(("**torch.compile calls**", [len(r["compiled_steps"]) for r in results]))
    rows.append(("**getattr/hasattr outside kinds**", [r["probes"]["total"] for r in results]))
    for b in PROBES:
        rows.append((f"{b}", [r["probes"]["per_builtin"][b] for r in results]))
    for f in probe_folders:
        rows.append((f"probes {f}/", [r["probes"]["per_folder"].get(f, "-") for r in results]))
    rows.append(("distinct probed names", [r["probes"]["distinct_names"] for r in results]))
    rows.append(("probes with a non-literal name", [r["probes"]["non_literal"] for r in results]))
    rows.append(("**hand-built drafter config dicts**", [len(r.get("config_dicts", [])) for r in results]))
    rows.append(("**attention layers written out** (`self.q = nn.Linear`)",
                 [len(r.get("attention_layers", [])) for r in results]))
    rows.append(("files skipped (parse error)", [len(r["skipped"]) for r in results]))
    lines = ["| count | " + " | ".join(_label(r) for r in results) + " |",
             "|---|" + "---:|" * len(results)]
    lines += [f"| {name} | " + " | ".join(str(v) for v in vals) + " |" for name, vals in rows]
    return "\n".join(lines)


def details(r: dict) -> str:
    def names(items):
        return ", ".join(f"{i['name']} ({i['file']})" for i in items) or "none"
    out = [f"### {_label(r)}", "",
           f"- KV caches: {names(r['kv_caches'])}",
           f"- samplers: {names(r['samplers'])}",
           f"- generation loops: {names(r['generation_loops'])}",
           f"- torch.compile: {', '.join(r['compiled_steps']) or 'none'}",
           f"- hand-built config dicts: {', '.join(r.get('config_dicts', [])) or 'none'}",
           f"- attention layers: {', '.join(r.get('attention_layers', [])) or 'none'}"]
    if r["skipped"]:
        out.append("- skipped: " + ", ".join(f"{s['file']} ({s['error']})" for s in r["skipped"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", default=None,
                    help=f"git revision to measure (repeatable; {WORKTREE} = the working tree; default: {WORKTREE})")
    ap.add_argument("--repo", type=Path, default=None, help="repository root (default: the one holding this script)")
    ap.add_argument("--out", type=Path, default=None, help="write the census as JSON here")
    args = ap.parse_args(argv)
    repo = args.repo or Path(__file__).resolve().parents[1]
    results = [census_revision(repo, rev) for rev in (args.rev or [WORKTREE])]
    print(table(results))
    print()
    print("\n\n".join(details(r) for r in results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"definitions": __doc__, "revisions": results}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
