"""Results pages generated from the suite's outputs: a record per run, rendered into docs/results.md.

A record is a `draftsmith bench suite` run's suite.json, trimmed to what a results page shows (`record_of`) and
committed under docs/results/NAME.json. In docs/results.md a block

    <!-- generated from results/NAME.json -->
    ... (what `render` makes of the record)
    <!-- end generated -->

holds that record's tables, with the machine, date, code and the command that reproduces them. The text between
the markers is never edited by hand: ``python -m draftsmith.eval.results_doc write`` re-renders every block, and
``check`` (run by the test suite) fails while a block differs from its record.

    python -m draftsmith.eval.results_doc add RUN_DIR/suite.json NAME   # docs/results/NAME.json from a run
    python -m draftsmith.eval.results_doc write                          # re-render every block
    python -m draftsmith.eval.results_doc check                          # exit 1, naming the stale blocks
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
BEGIN = re.compile(r"<!-- generated from results/([A-Za-z0-9._-]+)\.json -->\n")
END = "<!-- end generated -->"
ROW_KEYS = ("set", "sampling", "method", "plain", "prompts", "max_new_tokens", "tokens", "tokens_per_s", "tau",
            "acceptance_rate", "acceptance_by_position", "accepted_hist", "draft_ms_per_step", "speedup",
            "fastest_plain")


def record_of(suite: dict) -> dict:
    """What a results page keeps of a suite.json: provenance, the target, and every row's figures (acceptance by
    position to 8 draft positions, the accepted-count histogram to 16 bins), forecasts as they are."""
    missing = [k for k in ("command", "date", "environment", "target", "rows") if k not in suite]
    if missing:
        raise ValueError(f"not a suite.json: no {', '.join(missing)}")
    env = suite["environment"]
    rows = []
    for r in suite["rows"]:
        r = {k: r.get(k) for k in ROW_KEYS}
        r["acceptance_by_position"] = (r["acceptance_by_position"] or [])[:8]
        r["accepted_hist"] = (r["accepted_hist"] or [])[:16]
        rows.append(r)
    return {"command": suite["command"], "date": suite["date"],
            "environment": {k: env.get(k) for k in ("torch", "transformers", "torch_threads", "machine", "code")},
            "target": suite["target"], "sets": suite.get("sets") or sorted({r["set"] for r in rows}),
            "unavailable": suite.get("unavailable") or {}, "wall_s": suite.get("wall_s"), "rows": rows,
            "forecasts": suite.get("forecasts") or []}


OURS = "plain (ours"  # our plain decoding in any dtype: "plain (ours)", "plain (ours, float32)"


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def machine_line(rec: dict) -> str:
    env = rec["environment"]
    m, code = env.get("machine") or {}, env.get("code") or {}
    fam = (f", family {m['cpu_family']} model {m['cpu_model_number']}"
           if m.get("cpu_family") and m.get("cpu_model_number") else "")
    return (f"Machine: {m.get('cpu_kind', '?')}{fam}, {m.get('cpu_count', '?')} cores, {m.get('memory_gib', '?')} "
            f"GiB; torch {env.get('torch')} ({env.get('torch_threads')} threads). Date: {rec['date']}. Code: "
            f"{code.get('commit', 'not a git checkout')}{' with local changes' if code.get('dirty') else ''}. "
            f"Target: {rec['target']['name']} ({rec['target']['dtype']}).")


def render(rec: dict) -> str:
    """A record's tables: per set, one row per method, per sampling its tok/s, tau, acceptance at draft positions
    1..3 and its speed against our fastest plain decoding and against the fastest plain decoding of that run, any
    engine's (both named under the table)."""
    lines = [machine_line(rec), "", "Command:", "", "    " + rec["command"], ""]
    by_set: dict[str, dict[str, list[dict]]] = {}
    for r in rec["rows"]:
        by_set.setdefault(r["set"], {}).setdefault(r["sampling"], []).append(r)
    for set_name, samplings in by_set.items():
        labels = list(samplings)
        first = next(iter(samplings.values()))[0]
        ours_of = {lb: max((r for r in rows if r["plain"] and r["method"].startswith(OURS)),
                           key=lambda r: r["tokens_per_s"], default={}).get("method") for lb, rows in samplings.items()}
        methods: list[str] = []
        for rows in samplings.values():
            methods += [r["method"] for r in rows if r["method"] not in methods]
        lines += [f"{set_name}: {first['prompts']} prompts x {first['max_new_tokens']} tokens.", "",
                  "| method | " + " | ".join(f"{lb}: tok/s | tau | accept@1..3 | x our plain | x fastest plain"
                                           for lb in labels) + " |", "|---|" + "---|---|---|---|---|" * len(labels)]
        for name in methods:
            cells = []
            for lb in labels:
                r = next((x for x in samplings[lb] if x["method"] == name), None)
                if r is None:
                    cells += ["-"] * 5
                    continue
                acc = ", ".join(_f(a) for a in (r["acceptance_by_position"] or [])[:3]) or "-"
                fp = r.get("fastest_plain")
                sp = (r.get("speedup") or {}).get(fp) if fp else None
                ours = (r.get("speedup") or {}).get(ours_of[lb]) if ours_of[lb] else None
                cells += [_f(r["tokens_per_s"]), _f(r["tau"], ".3f"), acc, _x(ours), _x(sp)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        named = "; ".join(f"{lb}: ours = {ours_of[lb] or '-'}, any engine = "
                          f"{samplings[lb][0].get('fastest_plain') or '-'}" for lb in labels)
        lines += ["", f"Fastest plain decoding in this run: {named}.", ""]
    if rec.get("forecasts"):
        lines += ["Forecast tau beside the measured one (the trees stage's from the calibration split or the "
                  "held-out answers, the training probe's from logged top-1 accuracies):", "",
                  "| set | sampling | method | source | forecast tau | measured tau | measured / forecast |",
                  "|---|---|---|---|---|---|---|"]
        for f in rec["forecasts"]:
            lines.append(f"| {f['set']} | {f['sampling']} | {f['method']} | {f['source']} | "
                         f"{_f(f.get('forecast_tau'), '.3f')} | {_f(f.get('measured_tau'), '.3f')} | "
                         f"{_f(f.get('tau_ratio'), '.3f')} |")
        lines.append("")
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines)


def blocks(text: str) -> list[tuple[str, int, int]]:
    """(record name, start, end) of every generated block's body in ``text``; an unclosed block is an error."""
    out = []
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        nxt = BEGIN.search(text, m.end())
        if end < 0 or (nxt and nxt.start() < end):
            raise ValueError(f"the generated block of results/{m.group(1)}.json has no '{END}' before the next block")
        out.append((m.group(1), m.end(), end))
    return out


def sync(page: Path, records: Path, write: bool) -> list[str]:
    """Re-render every generated block of ``page`` from ``records``/NAME.json; returns the names of the blocks that
    differed (written back when ``write``). A block whose record is missing is an error."""
    text = page.read_text()
    stale, parts, at = [], [], 0
    for name, lo, hi in blocks(text):
        path = records / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"{page.name} has a block generated from {path}, which does not exist")
        body = render(json.loads(path.read_text())) + "\n"
        if text[lo:hi] != body:
            stale.append(name)
        parts += [text[at:lo], body]
        at = hi
    parts.append(text[at:])
    if write and stale:
        page.write_text("".join(parts))
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.eval.results_doc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default=str(DOCS), help="the docs folder (default: the repository's)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="trim a suite.json into docs/results/NAME.json")
    add.add_argument("suite")
    add.add_argument("name")
    sub.add_parser("write", help="re-render every generated block of docs/results.md")
    sub.add_parser("check", help="exit 1 while a generated block differs from its record")
    a = ap.parse_args(argv)
    docs = Path(a.docs)
    if a.cmd == "add":
        if not re.fullmatch(r"[A-Za-z0-9._-]+", a.name):
            raise SystemExit(f"record name {a.name!r}: letters, digits, '.', '_' and '-' only")
        rec = record_of(json.loads(Path(a.suite).read_text()))
        path = docs / "results" / f"{a.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {path}; put '<!-- generated from results/{a.name}.json -->' and '{END}' in results.md, "
              "then run `write`")
        return 0
    stale = sync(docs / "results.md", docs / "results", write=a.cmd == "write")
    if a.cmd == "check" and stale:
        print(f"docs/results.md: generated blocks out of date: {', '.join(stale)} (run `python -m "
              "draftsmith.eval.results_doc write`)", file=sys.stderr)
        return 1
    print(f"{'rewrote' if a.cmd == 'write' else 'up to date:'} {len(stale) if a.cmd == 'write' else 'all'} "
          f"{'block(s)' if a.cmd == 'write' else 'blocks'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
