"""Evaluation prompts: MT-Bench first turns (never trained on), or a user's own JSONL file."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from draftsmith.chat import prompt_token_ids
from draftsmith.paths import mtbench_questions_path


@dataclass
class Prompt:
    question_id: int
    category: str
    text: str
    ids: list[int]


def chat_ids(tokenizer, text: str) -> list[int]:
    """The user turn with the chat template and the assistant header (add_generation_prompt)."""
    return prompt_token_ids(tokenizer, [{"role": "user", "content": text}])


def spread(rows: list, n: int | None) -> list:
    """``n`` rows evenly spaced over ``rows`` (all of them when ``n`` is None or not smaller): the question files are
    grouped by category, so a spread subset covers every category."""
    if n is not None and n < 1:
        raise ValueError(f"need at least one prompt, got {n}")
    if n is None or n >= len(rows):
        return list(rows)
    return [rows[(i * len(rows)) // n] for i in range(n)]


def mtbench_rows(n: int | None = None, spread_out: bool = True) -> list[dict]:
    """MT-Bench's question rows (``question_id``, ``category``, ``turns``): ``n`` of them spread over the
    categories, or the first ``n`` without ``spread_out``, or all."""
    rows = [json.loads(line) for line in mtbench_questions_path().read_text().splitlines() if line.strip()]
    if spread_out or n is None:
        return spread(rows, n)
    if n < 1:
        raise ValueError(f"need at least one prompt, got {n}")
    return rows[:n]


def mtbench_prompts(tokenizer, n: int | None = None, spread: bool = False) -> list[Prompt]:
    """First turns of the 80 MT-Bench questions, chat template applied.

    With ``n``: the first ``n``, or with ``spread`` ``n`` evenly spaced ones
    (the file is grouped by category, so a spread subset covers them all).
    """
    return [Prompt(int(r["question_id"]), r["category"], r["turns"][0], chat_ids(tokenizer, r["turns"][0]))
            for r in mtbench_rows(n, spread)]


def user_prompts(tokenizer, path: str | Path, n: int | None = None) -> tuple[list[Prompt], dict]:
    """Prompts from a user's JSONL file, for judging a drafter on their own traffic.

    Each line: ``{"prompt": str}`` (one user turn), ``{"messages": [{"role", "content"}, ...]}``
    (a chat; a trailing assistant message is dropped, the rest is the prompt) or ``{"turns": [str, ...]}``
    (the first turn); optional ``"category"`` (default "user") and ``"id"``. Malformed lines are
    skipped and counted by reason (returned with the prompts), never fatal; a file with no usable
    line is an error.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    out: list[Prompt] = []
    skipped: Counter = Counter()
    first: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        reason = None
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row, reason = None, "invalid JSON"
        ids = text = None
        if reason is None and not isinstance(row, dict):
            reason = "not an object"
        elif reason is None:
            if isinstance(row.get("prompt"), str) and row["prompt"].strip():
                text = row["prompt"]
                ids = chat_ids(tokenizer, text)
            elif isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
                text = row["turns"][0]
                ids = chat_ids(tokenizer, text)
            elif isinstance(row.get("messages"), list) and row["messages"]:
                msgs = row["messages"]
                if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
                    msgs = msgs[:-1]
                if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in msgs):
                    reason = "messages need role and content strings"
                else:
                    text = msgs[-1]["content"]
                    ids = prompt_token_ids(tokenizer, msgs)
            else:
                reason = "no non-empty 'prompt', 'turns' or 'messages'"
        if reason:
            skipped[reason] += 1
            first.setdefault(reason, f"{path.name}:{lineno}")
            continue
        cat = row.get("category") if isinstance(row.get("category"), str) else "user"
        out.append(Prompt(len(out), cat, text, ids))
    if not out:
        raise ValueError(f"{path}: no usable prompt ({sum(skipped.values())} lines skipped: {dict(skipped)})")
    if n is not None:
        out = out[:n]
    return out, {"skipped": dict(skipped), "first_skipped_at": first}
