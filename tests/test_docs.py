"""The front door stays readable and honest: the README is a user's guide of at most 250 lines whose results are at
most 8 rows, each naming its machine, date and the results section with the command; every section of
docs/results.md names its machine and date and every table there what reproduces it; and no shipped file names
a development machine's paths."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a development machine's paths: a workspace, a home, or a named temporary directory (mktemp templates are fine)
DEV_PATH = re.compile(r"(?<![\w.])(/work/|/root/|/home/[a-z]\w*/|/tmp/(?!\w*\.X{3,})[\w.-]+/)")
MACHINE = re.compile(r"EPYC|Xeon|H100|H200|NVIDIA|Apple|Graviton|CPU", re.I)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _results_rows(readme: str) -> list[list[str]]:
    section = readme.split("\n## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]  # past the header and its rule


def test_readme_is_short_and_its_results_name_machine_date_and_source():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    rows = _results_rows(readme)
    assert 1 <= len(rows) <= 8
    for claim, figure, where in rows:
        assert MACHINE.search(where) or MACHINE.search(claim), claim
        assert DATE.search(where), claim
        assert "docs/results.md" in where, claim  # the section holds the command that reproduces it


# what reproduces a results table: a command in backticks or an indented block, a "command" column, the tests that
# measured it, or a stated scratch measurement that nothing in the repository reproduces
COMMAND = re.compile(r"`(draftsmith |python -m |\.venv/bin/|bash |git clone|OMP_NUM_THREADS|accelerate launch|llama-)"
                     r"|^ {4}\S|\btests/test_\w+\.py|\bscratch\b", re.M)
TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
# the results page also names machines by the short names its preamble defines ("AVX2", "AVX-512")
RESULTS_MACHINE = re.compile(MACHINE.pattern + r"|AVX", re.I)


def results_sections_missing(text: str) -> list[str]:
    """What each numbered section of a results page lacks: a machine, a date, and for each of its tables, something
    that reproduces it (`COMMAND`) in the same section or a "command" column."""
    missing = []
    for sec in re.split(r"\n(?=## \d+\.)", text)[1:]:
        title = sec.splitlines()[0][:60]
        if not RESULTS_MACHINE.search(sec):
            missing.append(f"{title}: no machine")
        if not DATE.search(sec):
            missing.append(f"{title}: no date")
        lines = sec.splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.startswith("|") and TABLE_RULE.match(lines[i + 1]):
                if "command" not in line.lower() and not COMMAND.search(sec):
                    missing.append(f"{title}: the table {line[:40]!r} has no command")
    return missing


def test_every_results_section_names_machine_date_and_command():
    """docs/results.md: every numbered section names its machine and date, and every table has what reproduces it."""
    missing = results_sections_missing((ROOT / "docs" / "results.md").read_text())
    assert not missing, "\n".join(missing)


def test_the_results_check_can_fail():
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert results_sections_missing(f"# R\n\n## 1. X\n\nXeon, 2026-11-29\n\n{table}") == [
        "## 1. X: the table '| a | b |' has no command"]
    assert results_sections_missing(f"# R\n\n## 1. X\n\n`draftsmith eval` on a Xeon\n\n{table}") == ["## 1. X: no date"]
    assert results_sections_missing("# R\n\n## 1. X\n\n`draftsmith eval` on 2026-11-29\n") == ["## 1. X: no machine"]
    assert not results_sections_missing(f"# R\n\n## 1. X\n\nEPYC, 2026-11-29:\n\n    python -m b\n\n{table}")


def _shipped_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = out.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file under the root
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    this = str(Path(__file__).resolve().relative_to(ROOT))  # this file spells the patterns out
    return [ROOT / n for n in names if not n.startswith(("runs/", ".venv")) and n != this and (ROOT / n).is_file()]


def test_no_shipped_file_names_a_development_machines_paths():
    bad = []
    for p in _shipped_files():
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if DEV_PATH.search(line):
                bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad[:20])


def test_the_path_check_can_fail():
    assert DEV_PATH.search("see /work/main/runs/x.json")
    assert DEV_PATH.search("cached in /root/.cache/foo")
    assert DEV_PATH.search("written to /tmp/tmpab12/out.json")
    assert not DEV_PATH.search("SITE=$(mktemp -d /tmp/draftsmith_site.XXXX)")
    assert not DEV_PATH.search("runs/quickstart/final")
