"""SuffixDecoding's global index seeded from a data stage's answers (train/data/suffix_seed.py)."""

import json

import pytest

from draftsmith.drafters.suffix import SuffixConfig, SuffixDrafter
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.mtbench import chat_ids
from draftsmith.train.data.suffix_seed import index_from_data, reply_runs


def test_reply_runs():
    assert reply_runs([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert reply_runs([]) == [] and reply_runs([0, 0]) == []


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_index_holds_every_answer_as_generated_and_counts_bad_rows(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo there"},
                                    {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}],
            "finished": [True, False]}
    no_reply = {"id": "b", "messages": [{"role": "user", "content": "only a question"}], "finished": []}
    _write(tmp_path / "train.jsonl", [good, "{not json", no_reply, ""])
    index, stats = index_from_data(tmp_path / "train.jsonl", tok)
    assert stats["conversations"] == 1 and stats["replies"] == 2
    assert stats["skipped"] == {"corrupt_rows": 1, "no_assistant_tokens": 1}
    # each reply is one response of the index: the finished one with its end-of-turn token, the cut one without
    got = [tok.decode(list(index.index.toks[s:e])) for _, s, e in index.responses]
    assert got == ["yo there<|im_end|>", "ab"]
    assert stats["indexed_tokens"] == index.indexed_tokens == sum(e - s for _, s, e in index.responses)


def test_missing_file_is_a_clear_error(tiny_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="run the data stage first"):
        index_from_data(tmp_path / "nope.jsonl", tiny_target.tokenizer)


def test_a_seeded_index_drafts_the_data_and_stays_lossless(tmp_path):
    """An answer in the data is drafted in full by a seeded index (many tokens a step), and the output is the
    plain greedy output; an unseeded index drafts little on its first generation."""
    from tests.tiny import make_tiny_target

    target = make_tiny_target(init_std=1.0)  # large weights: a varied greedy answer (the default repeats a token)
    tok = target.tokenizer
    plain = SpeculativeDecoder(target, sampling=SamplingParams(0.0))
    prompt = chat_ids(tok, "hello world")
    want = plain.generate(prompt, 24).tokens
    answer = tok.decode(want[:-1] if want[-1] == tok.eos_token_id else want)
    row = {"id": "x", "messages": [{"role": "user", "content": "something else"},
                                   {"role": "assistant", "content": answer}], "finished": [True]}
    _write(tmp_path / "train.jsonl", [row])
    cfg = SuffixConfig(min_score=0.0)
    index, _ = index_from_data(tmp_path / "train.jsonl", tok, cfg)
    seeded = SpeculativeDecoder(target, SuffixDrafter(cfg, index), sampling=SamplingParams(0.0))
    fresh = SpeculativeDecoder(target, SuffixDrafter(cfg), sampling=SamplingParams(0.0))
    r, f = seeded.generate(prompt, 24), fresh.generate(prompt, 24)
    held = [list(index.index.toks[s:e]) for _, s, e in index.responses]
    assert held[0][: len(want) - 1] == want[: len(want) - 1]  # the index holds the answer as generated
    assert r.tokens == want == f.tokens
    assert len(set(want)) > 8 and len(r.steps) <= len(want) // 4 < len(f.steps)  # the seeded index drafted it


def test_saved_index_loads_back_for_its_target_only(tiny_target, tmp_path):
    from draftsmith.drafters.suffix import SuffixIndex
    from draftsmith.train.data.suffix_seed import save_index_from_data

    row = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo there"}],
           "finished": [True]}
    _write(tmp_path / "train.jsonl", [row])
    stats = save_index_from_data(tmp_path / "train.jsonl", tiny_target.tokenizer, tmp_path / "idx",
                                 tiny_target.fingerprint)
    back = SuffixIndex.load(tmp_path / "idx", fingerprint=tiny_target.fingerprint)
    assert back.indexed_tokens == stats["indexed_tokens"] > 0 and stats["replies"] == 1
    with pytest.raises(ValueError, match="saved for target"):
        SuffixIndex.load(tmp_path / "idx", fingerprint="another")


def test_the_quickstart_bench_verifies_suffix_drafts_in_the_graph_the_trees_stage_compiled():
    """The bench stage's SuffixDecoding drafts fit the row bucket of the recipe's largest tree: a longer draft
    would compile another graph (a minute of the quickstart's budget; results-log §21)."""
    from pathlib import Path

    from draftsmith.pipeline.stages import BENCH_SUFFIX
    from draftsmith.engine.fastpath import bucket
    from draftsmith.recipe import load_recipe

    r = load_recipe(Path(__file__).parents[1] / "recipes" / "quickstart.yaml")
    assert r.eval.suffix_from_data
    assert bucket(BENCH_SUFFIX.max_spec_tokens + 1) == bucket(max(r.train.tree_budgets) + 1)
