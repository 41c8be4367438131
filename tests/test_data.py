import json
from collections import Counter

import pytest

from draftsmith.train.data import generate, sources


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_jsonl_rows_are_skipped_and_counted(tmp_path):
    p = _write(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "good one"}),
        "{not json",
        json.dumps({"prompt": ""}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
        json.dumps([1, 2, 3]),
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),
        json.dumps({"turns": ["a", "b"]}),
    ])
    skips = sources.SkipLog()
    got = list(sources.read_jsonl(p, "user", skips))
    assert [c.user_turns for c in got] == [["good one"], ["hi"], ["a", "b"]]
    assert skips.total == 4
    assert skips.counts["user: invalid JSON"] == 1
    assert skips.counts["user: empty prompt"] == 1
    assert skips.counts["user: unknown role 'alien'"] == 1
    assert "d.jsonl:2" in skips.examples["user: invalid JSON"]
    assert "skipped rows: 4" in skips.report()


def test_malformed_sharegpt_records(tmp_path):
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "r"},
                                      {"from": "human", "value": "q2"}]},
        {"id": "b"},
        {"id": "c", "conversations": [{"from": "gpt", "value": "only assistant"}]},
        {"id": "d", "conversations": [{"from": "human", "value": 3}]},
        "not a record",
        {"id": "e", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"}]},
    ]
    p = tmp_path / "s.json"
    p.write_text(json.dumps(recs))
    skips = sources.SkipLog()
    got = list(sources.read_sharegpt(p, "sg", skips))
    assert [(c.id, c.user_turns, c.system) for c in got] == [("sg:a", ["q1", "q2"], None), ("sg:e", ["q"], "sys")]
    assert skips.total == 4
    assert skips.counts["sg: no user turn"] == 1


def test_sharegpt_file_that_is_not_json_fails_clearly(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("[{\"id\": 1,,}]")
    with pytest.raises(ValueError, match="not valid JSON"):
        list(sources.read_sharegpt(p, "sg", sources.SkipLog()))


def test_hf_saved_dataset(tmp_path):
    import datasets
    ds = datasets.Dataset.from_list([{"prompt": "p1"}, {"prompt": ""}, {"prompt": "p3"}])
    ds.save_to_disk(str(tmp_path / "ds"))
    skips = sources.SkipLog()
    got = list(sources.read_hf_dataset(tmp_path / "ds", "hf", skips))
    assert [c.user_turns[0] for c in got] == ["p1", "p3"] and skips.total == 1


def test_mtbench_is_held_out():
    qs = sources.mtbench_questions()
    assert len(qs) == 80 and len({q["category"] for q in qs}) == 8
    keys = sources.mtbench_holdout_keys()
    convs = [sources.Conversation("x", "s", ["  " + qs[3]["turns"][0].upper() + " "]),
             sources.Conversation("y", "s", ["something else"])]
    stats = Counter()
    kept = list(sources.held_out(convs, keys, stats))
    assert [c.id for c in kept] == ["y"] and stats["held_out_mtbench"] == 1


def test_loss_mask_covers_assistant_tokens_only(tiny_target):
    tok = tiny_target.tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo there"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
    ids, mask = generate.render_example(tok, msgs, [True, False])
    assert len(ids) == len(mask)
    # finished reply: its end-of-turn token is a target; unfinished: it is not
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "yo there<|im_end|>ab"
    assert ids[-2] == tok.eos_token_id and mask[-2] == 0


@pytest.mark.real
def test_loss_mask_golden_on_real_tokenizer(real_target):
    tok = real_target.tokenizer
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sky."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]
    ids, mask = generate.render_example(tok, msgs, [True, True])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Blue, like the sky.<|im_end|>Green.<|im_end|>"
    # the generation prompt the target saw is exactly the unmasked prefix before the first reply
    first = mask.index(1)
    assert ids[:first] == generate.prompt_ids(tok, msgs[:1])


def test_long_prompt_policies():
    ids = list(range(10))
    assert generate.fit_prompt(ids, 20, "error", "c") == ids
    with pytest.raises(generate.PromptTooLongError, match="c: prompt is 10 tokens but only 4 fit"):
        generate.fit_prompt(ids, 4, "error", "c")
    assert generate.fit_prompt(ids, 4, "truncate", "c") == [6, 7, 8, 9]
    assert generate.fit_prompt(ids, 4, "skip", "c") is None


def test_regenerate_is_resumable_and_respects_context(tiny_target, tmp_path):
    convs = [sources.Conversation(f"c{i}", "t", ["hello there " * (1 + i), "more"]) for i in range(5)]
    convs.append(sources.Conversation("long", "t", ["x" * 600]))
    out = tmp_path / "r.jsonl"
    with pytest.raises(generate.PromptTooLongError, match="long"):
        generate.regenerate(tiny_target, convs, out, max_new_tokens=8, max_turns=2, batch_size=3, max_seq_len=300)
    out.unlink(missing_ok=True)
    st = generate.regenerate(tiny_target, convs, out, max_new_tokens=8, max_turns=2, batch_size=3,
                             max_seq_len=300, on_long_prompt="skip")
    assert st["skipped_long_prompt"] == 1 and st["conversations"] == 5
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(len(r["messages"]) in (2, 4) for r in rows)
    # a second run resumes: nothing regenerated
    st2 = generate.regenerate(tiny_target, convs, out, max_new_tokens=8, max_turns=2, batch_size=3,
                              max_seq_len=300, on_long_prompt="skip")
    assert st2["resumed"] == 5 and st2["responses"] == 0 and st2["skipped_long_prompt"] == 1
    assert len(out.read_text().splitlines()) == 5


def test_batched_generation_equals_single(tiny_target):
    tok = tiny_target.tokenizer
    ps = [generate.prompt_ids(tok, [{"role": "user", "content": t}]) for t in ("a", "hello world", "xyz")]
    batched = generate.generate_batch(tiny_target, ps, 6)
    single = [generate.generate_batch(tiny_target, [p], 6)[0] for p in ps]
    assert batched == single
