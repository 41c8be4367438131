"""Long prompts for timing decoding deep in a context (`draftsmith.eval.humaneval.long_prompt_ids`, used by
``benchmarks.fastest_plain --long-prompts`` and ``benchmarks.family_check``)."""

import pytest

from draftsmith.chat import prompt_token_ids
from draftsmith.eval.humaneval import humaneval_problems, long_prompt_ids
from tests.tiny import make_tokenizer


def test_long_prompts_reach_their_length_start_at_their_own_problem_and_stop_at_the_first_stub_that_does():
    tok = make_tokenizer()
    probs = humaneval_problems()
    out = long_prompt_ids(tok, 3, 700)
    assert len(out) == 3 and len({tuple(x) for x in out}) == 3
    for i, ids in enumerate(out):
        assert len(ids) >= 700
        text = tok.decode(ids)
        assert probs[i]["prompt"] in text and (i == 0 or probs[i - 1]["prompt"] not in text)
        # one stub fewer is short of the length: the prompt is cut at the first stub that makes it long enough
        n = sum(1 for p in probs[i:i + 10] if p["prompt"] in text)
        shorter = "".join(p["prompt"] for p in probs[i:i + n - 1])
        assert len(prompt_token_ids(tok, [{"role": "user", "content": shorter}])) < 700


def test_long_prompts_refuse_what_they_cannot_give():
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="min_tokens >= 1"):
        long_prompt_ids(tok, 2, 0)
    with pytest.raises(ValueError, match="fewer than"):
        long_prompt_ids(tok, 1, 10_000_000)
