"""The front door stays readable and honest: the README is a user's guide of at most 250 lines whose results are at
most 8 rows, each naming its machine, date and the results section with the command; every section of
docs/results.md (today's figures by topic) and of docs/results-log.md (every measurement by date) names its machine
and date and every table there what reproduces it; every reference to a section of either page, and every link
into one, names a section that exists; and no shipped file names a development machine's paths."""

import re
import subprocess
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("page", ["results.md", "results-log.md"])
def test_every_results_section_names_machine_date_and_command(page):
    """docs/results.md and docs/results-log.md: every numbered section names its machine and date, and every table
    has what reproduces it."""
    missing = results_sections_missing((ROOT / "docs" / page).read_text())
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


# A reference to a results section: "results-log §40.1", "docs/results-log.md §17-18", "results-log §34.1, §36",
# "docs/results-log.md sections 5 and 6" name sections of the dated log; "results §3", "docs/results.md §12" name
# topics of docs/results.md. Every number in the list (both ends of a range) must be a section of its page.
_NUM = r"\d+(?:\.\d+)?"
_ITEM = rf"§\s?{_NUM}(?:\s?-\s?§?{_NUM})?"
_LIST = rf"(?:{_ITEM}(?:(?:,\s*|\s+and\s+){_ITEM})*|sections?\s+{_NUM}(?:\s+and\s+{_NUM})*)"
LOG_REF = re.compile(rf"\bresults-log(?:\.md)?\s+({_LIST})")
RESULTS_REF = re.compile(rf"(?<![\w/.-])(?:docs/)?results(?:\.md)?\s+({_LIST})")
# a markdown link into either page with an anchor: (docs/results.md#3-the-quickstart...), (results-log.md#401-...)
PAGE_LINK = re.compile(r"\]\((?:\.\./)?(?:docs/)?(results(?:-log)?\.md)#([^)\s]+)\)")


def section_numbers(text: str) -> set[str]:
    """The numbers of a page's numbered sections: "## 16. Title" gives 16, "### 40.1 Title" gives 40.1."""
    return {m.group(1) for m in re.finditer(r"^#{2,3} (\d+(?:\.\d+)?)\.?\s", text, re.M)}


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    anchor numbered -1, -2, ..."""
    anchors, seen = set(), {}
    for m in re.finditer(r"^#{1,6} (.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def references_missing(text: str, log_sections: set[str], topics: set[str],
                       anchors: dict[str, set[str]] | None = None) -> list[str]:
    """What a text cites that does not exist: a results-log section, a docs/results.md topic, or (where the pages'
    anchors are given) a link's anchor into either page."""
    bad = []
    for pattern, known, page in ((LOG_REF, log_sections, "results-log"), (RESULTS_REF, topics, "results")):
        for m in pattern.finditer(text):
            bad += [f"{page} §{n} ({m.group(0)!r})" for n in re.findall(_NUM, m.group(1)) if n not in known]
    for m in PAGE_LINK.finditer(text):
        if anchors is not None and m.group(2) not in anchors[m.group(1)]:
            bad.append(f"{m.group(1)}#{m.group(2)}")
    return bad


def test_every_reference_to_a_results_section_exists():
    """Code comments, recipes, tests, docs and the CHANGELOG cite the dated log by its stable section numbers and the
    topic page by its topics: each cited section, and each linked anchor, exists."""
    log = (ROOT / "docs" / "results-log.md").read_text()
    topics_page = (ROOT / "docs" / "results.md").read_text()
    log_sections, topics = section_numbers(log), section_numbers(topics_page)
    anchors = {"results-log.md": heading_anchors(log), "results.md": heading_anchors(topics_page)}
    assert {"1", "16.4", "40.1", "44"} <= log_sections and {"1", "3"} <= topics
    bad = []
    for p in _shipped_files():
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        bad += [f"{p.relative_to(ROOT)}: {b}" for b in references_missing(text, log_sections, topics, anchors)]
    assert not bad, "\n".join(bad[:20])


def test_the_reference_check_can_fail():
    log, topics = section_numbers("## 2. A\n\n### 2.1 B\n\n## 40. C\n\n### 40.1 D\n"), {"1", "3"}
    assert log == {"2", "2.1", "40", "40.1"}
    ok = "results-log §2.1, §40 and results-log.md §40.1; docs/results-log.md sections 2 and 40; results §3"
    assert references_missing(ok, log, topics) == []
    assert references_missing("see results-log §40.2 (2026-11-29)", log, topics) == [
        "results-log §40.2 ('results-log §40.2')"]
    assert references_missing("docs/results-log.md §2-5", log, topics) == ["results-log §5 ('results-log.md §2-5')"]
    assert references_missing("(docs/results.md §7)", log, topics) == ["results §7 ('docs/results.md §7')"]
    assert references_missing("the old results §44)", log, topics) == ["results §44 ('results §44')"]
    anchors = {"results.md": heading_anchors("# R\n\n## 3. The quickstart, from a `fresh` clone\n"),
               "results-log.md": heading_anchors("## 40.1 The quickstart\n\n## 40.1 The quickstart\n")}
    assert anchors == {"results.md": {"r", "3-the-quickstart-from-a-fresh-clone"},
                       "results-log.md": {"401-the-quickstart", "401-the-quickstart-1"}}
    good = "[t](docs/results.md#3-the-quickstart-from-a-fresh-clone), [l](results-log.md#401-the-quickstart-1)"
    assert references_missing(good, log, topics, anchors) == []
    assert references_missing("[l](../docs/results-log.md#40-gone)", log, topics, anchors) == [
        "results-log.md#40-gone"]
