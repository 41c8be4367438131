"""How much of a documentation page is history and local bookkeeping rather than today's figures.

Reads markdown files as text and prints, per file and in total:

    python -m benchmarks.docs_counts README.md docs/results.md
    git show 3bd870c:docs/results.md > old_results.md && python -m benchmarks.docs_counts old_results.md

- ``lines``: lines of the file.
- ``table rows``: lines that start with ``|``, less the rules under a table's header (``|---|---|``).
- ``history words``: whole-word, case-insensitive occurrences of session, was, before, now, earlier, previous
  and goal (the words a dated log uses to say what changed).
- ``commit-like``: word-bounded tokens of 7-40 lower-case hexadecimal characters holding at least one digit and at
  least one letter (a commit hash, or a hash prefix like a fingerprint's).
- ``runs/ paths``: occurrences of ``runs/`` not preceded by a letter, digit, ``_``, ``.`` or ``-`` (local output
  directories, inside commands or not).

The last three leave out a markdown link's target (``](...)``): an anchor spells its heading's words, not the page's.
"""

import argparse
import re
import sys
from pathlib import Path

HISTORY = re.compile(r"\b(?:session|was|before|now|earlier|previous|goal)\b", re.I)
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
RUNS = re.compile(r"(?<![\w.-])runs/")
RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
COLUMNS = ("lines", "table rows", "history words", "commit-like", "runs/ paths")


def counts(text: str) -> dict[str, int]:
    """The counts above for one text."""
    lines = text.splitlines()
    prose = LINK_TARGET.sub("]", text)
    return {
        "lines": len(lines),
        "table rows": sum(1 for ln in lines if ln.startswith("|") and not RULE.match(ln)),
        "history words": len(HISTORY.findall(prose)),
        "commit-like": sum(1 for t in HEX.findall(prose) if re.search(r"\d", t) and re.search(r"[a-f]", t)),
        "runs/ paths": len(RUNS.findall(prose)),
    }


def table(rows: list[tuple[str, dict[str, int]]]) -> str:
    """A markdown table of the counts, one row per file, and a total when there is more than one file."""
    if len(rows) > 1:
        rows = rows + [("total", {c: sum(r[c] for _, r in rows) for c in COLUMNS})]
    out = ["| file | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    out += [f"| {name} | " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for name, r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="markdown files")
    args = ap.parse_args(argv)
    rows = []
    for path in args.files:
        try:
            rows.append((str(path), counts(path.read_text(encoding="utf-8"))))
        except OSError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
