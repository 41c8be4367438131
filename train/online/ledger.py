"""The online job's ledger (SQLite) and the log-directory tailer.

Exactly-once: the tailer only advances offsets in memory. Everything read
since the last commit (file offsets, accepted records with the update that
applied them, held-back records, quarantined lines) is committed in ONE
SQLite transaction together with the name of the model directory that
includes those records, and that directory is written and fsynced before the
transaction. A kill -9 before the commit leaves the previous offsets and the
previous model (the records are read and applied again, from the same state);
after it, both moved together. So no record is lost or applied twice.

A record's identity is ``<file name>:<byte offset>``: the server's log files
are never renamed (rotation opens a new file), so it is stable.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from draftsmith.traffic import LOG_GLOB

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (name TEXT PRIMARY KEY, offset INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS records (
  rid INTEGER PRIMARY KEY AUTOINCREMENT, src TEXT UNIQUE NOT NULL, holdout INTEGER NOT NULL,
  update_id INTEGER, prompt_len INTEGER NOT NULL, ids BLOB NOT NULL, rejected TEXT NOT NULL,
  drafter_version TEXT);
CREATE TABLE IF NOT EXISTS quarantine (src TEXT PRIMARY KEY, reason TEXT NOT NULL, line TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS updates (
  update_id INTEGER PRIMARY KEY, model TEXT NOT NULL, n_new INTEGER NOT NULL, n_replay INTEGER NOT NULL,
  n_holdout INTEGER NOT NULL, n_quarantined INTEGER NOT NULL, records_applied INTEGER NOT NULL,
  train TEXT, gate TEXT, version TEXT, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""


@dataclass
class PendingRecord:
    src: str
    holdout: bool
    prompt_len: int
    ids: list[int]
    rejected: list[int]
    drafter_version: str | None


@dataclass
class Pending:
    """What was read since the last commit."""

    records: list[PendingRecord] = field(default_factory=list)
    quarantined: list[tuple[str, str, str]] = field(default_factory=list)  # (src, reason, line)
    offsets: dict[str, int] = field(default_factory=dict)
    since: float | None = None  # when the first pending line was read

    @property
    def lines(self) -> int:
        return len(self.records) + len(self.quarantined)

    def train_records(self) -> list[PendingRecord]:
        return [r for r in self.records if not r.holdout]


class Ledger:
    """The job's SQLite state: offsets, records, quarantine counts, updates, the committed model."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.dir / "ledger.sqlite", isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ reads
    def meta(self, key: str, default=None):
        row = self.db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def offsets(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT name, offset FROM files"))

    def last_update(self) -> dict | None:
        cur = self.db.execute("SELECT * FROM updates ORDER BY update_id DESC LIMIT 1")
        row = cur.fetchone()
        return None if row is None else dict(zip([d[0] for d in cur.description], row))

    def updates(self) -> list[dict]:
        cur = self.db.execute("SELECT * FROM updates ORDER BY update_id")
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    def counts(self) -> dict:
        """Records applied, held back and quarantined (by reason)."""
        applied = self.db.execute("SELECT COUNT(*) FROM records WHERE holdout = 0").fetchone()[0]
        held = self.db.execute("SELECT COUNT(*) FROM records WHERE holdout = 1").fetchone()[0]
        q = dict(self.db.execute("SELECT reason, COUNT(*) FROM quarantine GROUP BY reason"))
        return {"applied": applied, "held_back": held, "quarantined": q,
                "records_applied_in_model": self.meta("records_applied", 0), "model": self.meta("model")}

    def _rows(self, sql: str, args=()) -> list[dict]:
        out = []
        for src, pl, ids, rej, ver in self.db.execute(sql, args):
            out.append({"src": src, "prompt_len": pl, "ids": np.frombuffer(ids, dtype=np.int32).tolist(),
                        "rejected": json.loads(rej), "drafter_version": ver})
        return out

    def holdout_window(self, n: int) -> list[dict]:
        """The ``n`` most recent held-back records, oldest first."""
        rows = self._rows("SELECT src, prompt_len, ids, rejected, drafter_version FROM records WHERE holdout = 1 "
                          "ORDER BY rid DESC LIMIT ?", (n,))
        return rows[::-1]

    def replay_sample(self, k: int, buffer: int, seed: int) -> list[dict]:
        """``k`` applied records drawn without replacement from the ``buffer`` most recent ones."""
        if k <= 0:
            return []
        rids = [r[0] for r in self.db.execute(
            "SELECT rid FROM records WHERE holdout = 0 AND update_id IS NOT NULL ORDER BY rid DESC LIMIT ?", (buffer,))]
        if not rids:
            return []
        pick = np.random.default_rng(seed).choice(len(rids), size=min(k, len(rids)), replace=False)
        chosen = sorted(rids[i] for i in pick)
        marks = ",".join("?" * len(chosen))
        return self._rows(f"SELECT src, prompt_len, ids, rejected, drafter_version FROM records WHERE rid IN ({marks}) "
                          f"ORDER BY rid", chosen)

    def quarantine_rows(self) -> list[tuple[str, str, str]]:
        return list(self.db.execute("SELECT src, reason, line FROM quarantine ORDER BY rowid"))

    # ------------------------------------------------------------------ the one commit
    def commit(self, pending: Pending, *, update_id: int, model: str, records_applied: int, n_replay: int,
               train: dict | None) -> None:
        """Offsets, records, quarantine, the update row and the model pointer, in one transaction."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            for name, off in pending.offsets.items():
                db.execute("INSERT INTO files(name, offset) VALUES(?, ?) ON CONFLICT(name) DO UPDATE SET offset = ?",
                           (name, off, off))
            for r in pending.records:
                db.execute("INSERT INTO records(src, holdout, update_id, prompt_len, ids, rejected, drafter_version) "
                           "VALUES(?, ?, ?, ?, ?, ?, ?)",
                           (r.src, int(r.holdout), None if r.holdout else update_id, r.prompt_len,
                            np.asarray(r.ids, dtype=np.int32).tobytes(), json.dumps(r.rejected), r.drafter_version))
            for src, reason, line in pending.quarantined:
                db.execute("INSERT INTO quarantine(src, reason, line) VALUES(?, ?, ?)", (src, reason, line))
            n_hold = sum(r.holdout for r in pending.records)
            db.execute("INSERT INTO updates(update_id, model, n_new, n_replay, n_holdout, n_quarantined, "
                       "records_applied, train, time) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (update_id, model, len(pending.records) - n_hold, n_replay, n_hold, len(pending.quarantined),
                        records_applied, json.dumps(train), time.time()))
            for k, v in (("model", model), ("records_applied", records_applied), ("update_id", update_id)):
                db.execute("INSERT INTO meta(k, v) VALUES(?, ?) ON CONFLICT(k) DO UPDATE SET v = ?",
                           (k, json.dumps(v), json.dumps(v)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def set_meta(self, key: str, value) -> None:
        self.db.execute("INSERT INTO meta(k, v) VALUES(?, ?) ON CONFLICT(k) DO UPDATE SET v = ?",
                        (key, json.dumps(value), json.dumps(value)))

    def set_gate(self, update_id: int, gate: dict, version: str | None) -> None:
        self.db.execute("UPDATE updates SET gate = ?, version = ? WHERE update_id = ?",
                        (json.dumps(gate), version, update_id))


class Tailer:
    """Reads complete new lines from every ``*.jsonl`` file of a log directory, from given offsets.

    New files are picked up as they appear (rotation opens a new file). A partly written last
    line is left for the next poll; in a file that is no longer the newest and has not changed
    for ``torn_grace_s`` it can never be completed (its writer crashed) and is returned as torn.
    A file shorter than its committed offset was replaced: it is read again from 0 (counted).
    """

    def __init__(self, log_dir: str | Path, offsets: dict[str, int], *, torn_grace_s: float = 60.0):
        self.dir = Path(log_dir)
        self.offsets = dict(offsets)
        self.torn_grace_s = torn_grace_s
        self.replaced = 0

    def poll(self, max_lines: int | None = None) -> list[tuple[str, bytes, bool]]:
        """[(src, line without newline, torn)] in file-name order; advances ``self.offsets``."""
        if not self.dir.is_dir():
            return []
        files = sorted(p for p in self.dir.glob(LOG_GLOB) if p.is_file())
        out: list[tuple[str, bytes, bool]] = []
        for i, p in enumerate(files):
            off = self.offsets.get(p.name, 0)
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                continue
            if size < off:
                self.replaced += 1
                off = 0
            if size == off:
                self.offsets[p.name] = off
                continue
            with open(p, "rb") as f:
                f.seek(off)
                data = f.read(size - off)
            pos = 0
            while True:
                if max_lines is not None and len(out) >= max_lines:
                    break
                nl = data.find(b"\n", pos)
                if nl < 0:
                    break
                out.append((f"{p.name}:{off + pos}", data[pos:nl], False))
                pos = nl + 1
            rest = data[pos:]
            if rest and (max_lines is None or len(out) < max_lines) and i < len(files) - 1 \
                    and time.time() - p.stat().st_mtime > self.torn_grace_s:
                out.append((f"{p.name}:{off + pos}", rest, True))
                pos = len(data)
            self.offsets[p.name] = off + pos
            if max_lines is not None and len(out) >= max_lines:
                break
        return out


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (and ``path``)."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [d for d in path.rglob("*") if d.is_dir()] + [path, path.parent]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
