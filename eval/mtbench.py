"""MT-Bench first turns as chat-formatted prompts (evaluation only: never train on them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from draftsmith.paths import mtbench_questions_path


@dataclass
class Prompt:
    question_id: int
    category: str
    text: str
    ids: list[int]


def chat_ids(tokenizer, text: str) -> list[int]:
    """The user turn with the chat template and the assistant header (add_generation_prompt)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def mtbench_prompts(tokenizer, n: int | None = None, spread: bool = False) -> list[Prompt]:
    """First turns of the 80 MT-Bench questions, chat template applied.

    With ``n``: the first ``n``, or with ``spread`` ``n`` evenly spaced ones
    (the file is grouped by category, so a spread subset covers them all).
    """
    rows = [json.loads(line) for line in mtbench_questions_path().read_text().splitlines() if line.strip()]
    if n is not None:
        if n < 1:
            raise ValueError(f"need at least one prompt, got {n}")
        if spread and n < len(rows):
            rows = [rows[(i * len(rows)) // n] for i in range(n)]
        else:
            rows = rows[:n]
    return [Prompt(int(r["question_id"]), r["category"], r["turns"][0], chat_ids(tokenizer, r["turns"][0]))
            for r in rows]
