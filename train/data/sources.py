"""Reading prompts from every supported source, with bad rows counted.

Every source yields ``Conversation`` objects holding the *user* turns (and an
optional system prompt). Assistant turns found in the source are ignored:
self-distillation regenerates them with the target. Malformed rows are
skipped and counted by reason in a ``SkipLog``, never silently dropped.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from draftsmith import paths

_HUMAN = {"human", "user"}
_GPT = {"gpt", "assistant", "bard", "chatgpt", "bing", "model"}
_SYSTEM = {"system"}


@dataclass
class Conversation:
    id: str
    source: str
    user_turns: list[str]
    system: str | None = None
    # the source's assistant turns (reply i answers user turn i), kept for teacher-forced data
    # (data.regenerate: false); self-distillation ignores them
    replies: list[str] | None = None


@dataclass
class SkipLog:
    """Counts of skipped rows by (source, reason), with a few examples."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def skip(self, source: str, reason: str, where: str) -> None:
        key = f"{source}: {reason}"
        self.counts[key] += 1
        self.examples.setdefault(key, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        return {"total": self.total, "by_reason": dict(self.counts), "first_example": self.examples}

    def report(self) -> str:
        if not self.counts:
            return "skipped rows: 0"
        lines = [f"skipped rows: {self.total}"]
        lines += [f"  {n:6d}  {k}  (first at {self.examples[k]})" for k, n in self.counts.most_common()]
        return "\n".join(lines)


def normalise(text: str) -> str:
    """Text key used to hold MT-Bench questions out of training data."""
    return re.sub(r"\s+", " ", text).strip().lower()


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions (evaluation only)."""
    rows = [json.loads(line) for line in paths.mtbench_questions_path().read_text().splitlines() if line.strip()]
    if len(rows) != 80:
        raise ValueError(f"expected 80 MT-Bench questions, found {len(rows)}")
    return rows


def mtbench_holdout_keys() -> set[str]:
    return {normalise(t) for q in mtbench_questions() for t in q["turns"]}


def _sharegpt_record(rec, source: str, where: str, skips: SkipLog) -> Conversation | None:
    if not isinstance(rec, dict):
        skips.skip(source, "record is not an object", where)
        return None
    conv = rec.get("conversations", rec.get("messages"))
    if not isinstance(conv, list) or not conv:
        skips.skip(source, "no 'conversations' list", where)
        return None
    users, replies, system = [], [], None
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            skips.skip(source, "turn is not an object", where)
            return None
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            skips.skip(source, "turn lacks a string role/from and value/content", where)
            return None
        role = role.lower()
        if role in _SYSTEM and i == 0:
            system = text
        elif role in _HUMAN:
            if not text.strip():
                skips.skip(source, "empty user turn", where)
                return None
            users.append(text)
        elif role in _GPT:
            if len(replies) < len(users):  # the first reply to the latest user turn
                replies.append(text)
        else:
            skips.skip(source, f"unknown role {role!r}", where)
            return None
    if not users:
        skips.skip(source, "no user turn", where)
        return None
    rid = rec.get("id", rec.get("question_id"))
    return Conversation(id=f"{source}:{rid if rid is not None else where}", source=source,
                        user_turns=users, system=system, replies=replies)


def _row_to_conversation(row, source: str, where: str, skips: SkipLog) -> Conversation | None:
    """One JSONL / dataset row: {prompt}, {messages}, {conversations} or {turns}."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        if not row["prompt"].strip():
            skips.skip(source, "empty prompt", where)
            return None
        rid = row.get("id", where)
        reply = row.get("response")
        return Conversation(id=f"{source}:{rid}", source=source, user_turns=[row["prompt"]],
                            system=row.get("system") if isinstance(row.get("system"), str) else None,
                            replies=[reply] if isinstance(reply, str) and reply.strip() else [])
    if isinstance(row, dict) and isinstance(row.get("turns"), list):
        turns = row["turns"]
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            skips.skip(source, "'turns' must be non-empty strings", where)
            return None
        return Conversation(id=f"{source}:{row.get('id', row.get('question_id', where))}", source=source,
                            user_turns=list(turns))
    return _sharegpt_record(row, source, where, skips)


def read_jsonl(path: str | Path, source: str, skips: SkipLog) -> Iterator[Conversation]:
    """A user JSONL file; malformed lines are skipped and counted."""
    path = Path(path)
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                skips.skip(source, "invalid JSON", f"{path.name}:{n} ({e.msg})")
                continue
            conv = _row_to_conversation(row, source, f"{path.name}:{n}", skips)
            if conv:
                yield conv


def read_sharegpt(path: str | Path, source: str, skips: SkipLog) -> Iterator[Conversation]:
    """A ShareGPT JSON file (a list of records) or JSONL of records."""
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); "
                             f"use JSONL to let bad rows be skipped one by one") from e
        for i, rec in enumerate(records):
            conv = _sharegpt_record(rec, source, f"{path.name}[{i}]", skips)
            if conv:
                yield conv
    else:
        yield from read_jsonl(path, source, skips)


def read_hf_dataset(path: str | Path, source: str, skips: SkipLog, split: str | None = None) -> Iterator[Conversation]:
    """A dataset saved with ``datasets.save_to_disk`` (never downloaded)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split or next(iter(ds))]
    for i, row in enumerate(ds):
        conv = _row_to_conversation(row, source, f"row {i}", skips)
        if conv:
            yield conv


def resolve_path(path: str) -> Path:
    """``builtin:sharegpt-dummy`` names a shipped file; anything else is a path."""
    if path == "builtin:sharegpt-dummy":
        return paths.sharegpt_dummy_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data source {path!r} does not exist")
    return p


def held_out(convs: Iterable[Conversation], keys: set[str], stats: Counter) -> Iterator[Conversation]:
    """Drop conversations that contain an MT-Bench question (eval only)."""
    for c in convs:
        if any(normalise(u) in keys for u in c.user_turns):
            stats["held_out_mtbench"] += 1
            continue
        yield c
