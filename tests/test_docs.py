"""The front door stays readable and honest: the README is a user's guide of at most 250 lines whose results are at
most 8 rows, each naming its machine, date and the results section with the command; and no shipped file names
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
