"""data.time_budget_s: the data stage's training-data generation bounded in wall-clock time.

Time is a fake clock (`generate.clock`) that moves one second per decode step of the batched engine, per
`generate_batch` call of the hf engine and per chat request to a server: the tests are exact and never
sleep. No new Magpie draw is started after its share of the budget, no new conversation after the whole;
answers in flight at its end are cut there (`data.at_budget_end: cut`, kept as unfinished replies), or, with
``finish``, finish all their turns and are written as an unbudgeted run writes them.
"""

import itertools
import json

import numpy as np
import pytest
import torch

from draftsmith.common.hidden_cache import target_states
from draftsmith.pipeline import stages as pipeline
from draftsmith.recipe import RecipeError, parse_recipe
from draftsmith.train.data import generate
from draftsmith.train.data.batchgen import BatchGenerator
from draftsmith.train.data.remote import ChatClient, regenerate_remote
from draftsmith.train.data.sources import Conversation
from tests.openai_stub import serve
from tests.tiny import make_tiny_target

WORDS = ["hello there", "tell me about cats", "why is the sky blue", "count to ten", "a poem please",
         "what is two plus two", "name a color", "say hi", "explain rain to a child", "list three fruits"]
NR = generate.NOT_REACHED


@pytest.fixture(scope="module")
def peaky():
    tgt = make_tiny_target(init_std=0.5, seed=3)
    tgt.model.generation_config.eos_token_id = [2, 0, 1]  # replies that end on their own: two-turn conversations
    return tgt


@pytest.fixture()
def clock(monkeypatch):
    """The fake clock: {"now": seconds}; each forward that generates a token (per row group) takes 1 s."""
    t = {"now": 0.0}
    monkeypatch.setattr(generate, "clock", lambda: t["now"])
    decode, batch, chat = BatchGenerator._decode, generate.generate_batch, ChatClient.chat

    def tick(f):
        def timed(*a, **kw):
            t["now"] += 1.0
            return f(*a, **kw)
        return timed

    monkeypatch.setattr(BatchGenerator, "_decode", tick(decode))
    monkeypatch.setattr(generate, "generate_batch", tick(batch))
    monkeypatch.setattr(ChatClient, "chat", tick(chat))
    return t


def _convs(n, source="t"):
    return [Conversation(id=f"{source}{i}", source=source, user_turns=[f"{WORDS[i % len(WORDS)]} {i}",
                                                                         f"and then {i}?"])
            for i in range(n)]


def _rows(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


KW = dict(max_new_tokens=40, max_turns=2, batch_size=3, max_seq_len=400, max_rows=4)


# ------------------------------------------------------------------------------------------------- recipe
@pytest.mark.parametrize("key,value", [("time_budget_s", 0), ("time_budget_s", -3.0), ("magpie_budget_share", 0),
                                       ("magpie_budget_share", 1), ("magpie_budget_share", 1.5),
                                       ("magpie_budget_share", -0.2)])
def test_recipe_rejects_a_budget_that_is_not_positive_and_a_share_outside_0_1(key, value):
    with pytest.raises(RecipeError, match=f"data.{key}"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa"}, "data": {key: value}})


def test_recipe_budget_defaults_and_accepts():
    d = parse_recipe({"name": "x", "drafter": {"kind": "medusa"}}).data
    assert d.time_budget_s is None and d.magpie_budget_share == 0.35
    d = parse_recipe({"name": "x", "drafter": {"kind": "medusa"}},
                     ["data.time_budget_s=90", "data.magpie_budget_share=0.5"]).data
    assert d.time_budget_s == 90.0 and d.magpie_budget_share == 0.5


# ------------------------------------------------------------------------------------------ regeneration
@pytest.mark.parametrize("engine", ["batched", "hf"])
def test_a_passed_deadline_starts_no_conversation(peaky, tmp_path, clock, engine):
    clock["now"] = 10.0
    st = generate.regenerate(peaky, _convs(7), tmp_path / "t.jsonl", engine=engine, deadline=generate.Deadline(5.0),
                             **KW)
    assert st["conversations"] == 0 and st["responses"] == 0 and st[NR] == 7
    assert (tmp_path / "t.jsonl").read_text() == ""
    assert clock["now"] == 10.0  # not one token generated


def test_with_finish_conversations_in_flight_at_the_deadline_finish_all_their_turns(peaky, tmp_path, clock):
    convs = _convs(16)
    generate.regenerate(peaky, convs, tmp_path / "full.jsonl", **KW)
    clock["now"] = 0.0
    # the first decode step passes the deadline: the rows admitted before it (max_rows) are all that is started
    st = generate.regenerate(peaky, convs, tmp_path / "cut.jsonl", deadline=generate.Deadline(1.0),
                             at_budget_end="finish", **KW)
    got, full = _rows(tmp_path / "cut.jsonl"), _rows(tmp_path / "full.jsonl")
    assert len(got) == st["conversations"] == KW["max_rows"] and st[NR] == len(convs) - KW["max_rows"]
    assert got == {k: full[k] for k in got}  # second turns started after the deadline, rows as unbudgeted
    assert any(len(r["finished"]) == 2 for r in got.values())  # (so the check above covers a second turn)
    assert set(got) == {c.id for c in generate.budget_order(convs, 0)[:KW["max_rows"]]}  # in the budget's order


@pytest.mark.parametrize("fused", [False, True])
def test_answers_in_flight_at_the_deadline_are_cut_there_and_kept(peaky, tmp_path, clock, fused):
    """data.at_budget_end: cut (the default): the rows in flight end at the first step past the deadline, each
    reply the unbudgeted run's first tokens, written as unfinished (or finished, where it had ended); no later turn
    is started. With a fused cache their states are the cache's (the same as a forward over the written rows)."""
    convs = _convs(16)
    generate.regenerate(peaky, convs, tmp_path / "full.jsonl", **KW)
    clock["now"] = 0.0
    kw = {}
    if fused:
        kw["fused"] = generate.FusedCacheWriter(tmp_path / "cache", dtype="float32", shard_tokens=1000)
    st = generate.regenerate(peaky, convs, tmp_path / "cut.jsonl", deadline=generate.Deadline(3.0), **KW, **kw)
    got, full = _rows(tmp_path / "cut.jsonl"), _rows(tmp_path / "full.jsonl")
    assert len(got) == st["conversations"] == KW["max_rows"] and st[NR] == len(convs) - KW["max_rows"]
    assert set(got) == {c.id for c in generate.budget_order(convs, 0)[:KW["max_rows"]]}
    assert st[generate.CUT] >= 1 and st[generate.CUT] == sum(not r["finished"][-1] for r in got.values())
    for k, r in got.items():
        assert len(r["finished"]) == 1  # a second turn would have started past the deadline
        mine, theirs = r["messages"][1]["content"], full[k]["messages"][1]["content"]
        assert theirs.startswith(mine)  # the unbudgeted run's reply, cut
        assert (mine == theirs) if r["finished"][0] else len(mine) < len(theirs)
    assert sum(len(r["messages"][1]["content"]) for r in got.values()) < \
        sum(len(full[k]["messages"][1]["content"]) for k in got)  # something was cut
    if fused:  # the cut rows' states, from generation, are a forward's over the sequences the cache holds
        shard = tmp_path / "cache" / "shard-00000"
        tokens, starts, final = (np.load(shard / f"{f}.npy") for f in ("tokens", "starts", "final"))
        assert len(starts) - 1 == len(got) and st["fused_from_generation"] == len(got)
        for a, b in zip(starts[:-1], starts[1:]):
            ids = torch.from_numpy(tokens[a:b].astype("int64"))[None]
            ref = target_states(peaky, ids, torch.ones_like(ids), ["final"])["final"][0]
            torch.testing.assert_close(torch.from_numpy(final[a:b]).float(), ref.float(), atol=2e-5, rtol=1e-4)


def test_the_hf_engine_stops_between_batches(peaky, tmp_path, clock):
    convs = _convs(8)
    generate.regenerate(peaky, convs, tmp_path / "full.jsonl", engine="hf", **KW)
    clock["now"] = 0.0
    st = generate.regenerate(peaky, convs, tmp_path / "cut.jsonl", engine="hf", deadline=generate.Deadline(1.0), **KW)
    got, full = _rows(tmp_path / "cut.jsonl"), _rows(tmp_path / "full.jsonl")
    assert len(got) == KW["batch_size"] and st[NR] == len(convs) - KW["batch_size"]  # the first batch only
    assert set(got) == {c.id for c in generate.budget_order(convs, 0)[:KW["batch_size"]]}
    assert got == {k: full[k] for k in got}


def test_the_conversations_reached_are_a_sample_of_every_source(peaky, tmp_path, clock):
    """Long ShareGPT-like prompts and short Magpie-like ones: the length sort an unbudgeted run uses would
    reach only the short ones first; the budget's seeded order reaches both."""
    long = [Conversation(id=f"sharegpt:{i}", source="sharegpt0", user_turns=[f"{WORDS[i % 10]} {i} " * 4])
            for i in range(10)]
    short = [Conversation(id=f"magpie:0:{i}", source="magpie", user_turns=[f"q{i}"]) for i in range(10)]
    kw = {**KW, "max_turns": 1, "max_rows": 2, "max_new_tokens": 12}
    st = generate.regenerate(peaky, long + short, tmp_path / "t.jsonl", deadline=generate.Deadline(30.0), **kw)
    got = _rows(tmp_path / "t.jsonl")
    assert 4 <= len(got) <= 14 and st[NR] == 20 - len(got)
    by_length = sorted(long + short, key=lambda c: len(c.user_turns[0]))
    assert {c.source for c in by_length[:len(got)]} == {"magpie"}  # what the length sort would have reached
    assert {r["source"] for r in got.values()} == {"sharegpt0", "magpie"}


def test_through_a_server_the_deadline_holds_back_new_conversations(peaky, tmp_path, clock):
    convs = _convs(5)
    url, stop, seen = serve(peaky)
    try:
        kw = dict(url=url, model="tiny", concurrency=1, check="none", max_new_tokens=40, max_turns=2,
                  max_seq_len=400)
        clock["now"] = 3.0
        st = regenerate_remote(peaky, convs, tmp_path / "none.jsonl", deadline=generate.Deadline(2.0), **kw)
        assert st[NR] == 5 and st["conversations"] == 0 and seen["chat"] == 0
        clock["now"] = 0.0
        st = regenerate_remote(peaky, convs, tmp_path / "one.jsonl", deadline=generate.Deadline(1.0), **kw)
    finally:
        stop()
    generate.regenerate(peaky, convs, tmp_path / "full.jsonl", **KW)
    got, full = _rows(tmp_path / "one.jsonl"), _rows(tmp_path / "full.jsonl")
    assert st[NR] == 4 and list(got) == [generate.budget_order(convs, 0)[0].id]  # one request in flight
    assert got == {k: full[k] for k in got}


# ------------------------------------------------------------------------------------------------ Magpie
@pytest.mark.parametrize("engine", ["batched", "hf"])
def test_magpie_stops_drawing_at_its_deadline_and_keeps_the_first_prompts(peaky, clock, engine):
    kw = dict(max_new_tokens=24, seed=5, min_chars=1, max_rows=4, batch_size=4, engine=engine)
    full, sf = generate.synthesize_prompts(peaky, 12, **kw)
    assert not sf["stopped_time_budget"]
    clock["now"] = 0.0
    rounds = []
    cut, sc = generate.synthesize_prompts(peaky, 12, deadline=generate.Deadline(6.0),
                                          on_round=lambda new, draws: rounds.append(draws), **kw)
    assert sc["stopped_time_budget"] == 1 and 0 < len(cut) < len(full)
    assert [c.user_turns for c in cut] == [c.user_turns for c in full[:len(cut)]]  # the first ones, same ids
    assert [c.id for c in cut] == [c.id for c in full[:len(cut)]]
    if engine == "batched":
        assert 6.0 <= clock["now"] <= 6.0 + 24 and rounds and rounds[-1] < 23  # draws made, not the round's
    clock["now"] = 100.0
    none, sn = generate.synthesize_prompts(peaky, 12, deadline=generate.Deadline(1.0), done=cut, **kw)
    assert none == cut and sn["stopped_time_budget"] == 1 and clock["now"] == 100.0


# -------------------------------------------------------------------------------------------- data stage
def _recipe(tmp_path, name, budget=None, n=12, magpie=10, **data):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"turns": [f"{WORDS[i % 10]} {i}"]}) + "\n" for i in range(n)))
    return parse_recipe({
        "name": name, "output_dir": str(tmp_path / name), "seed": 0,
        "data": {"sources": [{"type": "jsonl", "path": str(src)}, {"type": "magpie", "count": magpie}],
                 "max_new_tokens": 16, "magpie_max_new_tokens": 24, "max_rows": 4, "max_seq_len": 400,
                 "heldout_mtbench": False, "fused_cache": False, "time_budget_s": budget, **data},
        "drafter": {"kind": "medusa", "num_heads": 2}})


def _meta(r):
    return json.loads((r.out / "data" / "meta.json").read_text())


def test_a_generous_budget_writes_what_no_budget_writes(peaky, tmp_path, clock, capsys):
    free, rich = _recipe(tmp_path, "free"), _recipe(tmp_path, "rich", budget=1e9)
    pipeline.stage_data(free, peaky)
    clock["now"] = 0.0
    pipeline.stage_data(rich, peaky)
    for f in ("train.jsonl", "magpie1.jsonl"):
        a, b = ((r.out / "data" / f).read_text().splitlines() for r in (free, rich))
        assert sorted(a) == sorted(b), f  # the same rows (in the order each run admitted them)
    meta = _meta(rich)["time_budget"]
    assert meta["not_reached"] == 0 and meta["magpie_prompts"]["stopped_by_budget"] is False
    assert meta["written"] == meta["conversations"] == len(_rows(rich.out / "data" / "train.jsonl"))
    assert meta["budget_s"] == 1e9 and meta["seconds_used"] == clock["now"]
    assert "time_budget" not in _meta(free)
    assert "data.time_budget_s=1e+09: 0 of" in capsys.readouterr().out


def test_a_tight_budget_cuts_magpie_at_its_share_and_counts_what_was_not_reached(peaky, tmp_path, clock, capsys):
    rich = _recipe(tmp_path, "rich", budget=1e9, n=30)
    pipeline.stage_data(rich, peaky)
    clock["now"] = 0.0
    r = _recipe(tmp_path, "tight", budget=200.0, magpie_budget_share=0.5, n=30)
    pipeline.stage_data(r, peaky)
    meta = _meta(r)
    tb, gen = meta["time_budget"], meta["generation"]
    # Magpie stopped drawing at 100 s (its share); the draws in flight took at most magpie_max_new_tokens more
    assert tb["magpie_prompts"]["stopped_by_budget"] and 0 < tb["magpie_prompts"]["kept"] < 10
    assert 100.0 <= tb["prompt_seconds"] <= 100.0 + 24
    prompts = (r.out / "data" / "magpie1.jsonl").read_text().splitlines()
    assert prompts == (rich.out / "data" / "magpie1.jsonl").read_text().splitlines()[:len(prompts)]
    # answers: some written, the rest counted, none lost silently
    rows = _rows(r.out / "data" / "train.jsonl")
    assert 0 < len(rows) == tb["written"] == gen["conversations"]
    assert tb["not_reached"] == gen[NR] > 0 and tb["written"] + tb["not_reached"] == tb["conversations"]
    assert 200.0 <= tb["seconds_used"] <= 200.0 + 16
    out = capsys.readouterr().out
    assert f"data.time_budget_s=200: {tb['not_reached']} of {tb['conversations']} conversations not reached" in out
    assert "magpie1: " in out and "of 10 prompts written" in out


class Killed(Exception):
    pass


def test_an_interrupted_budgeted_stage_resumes_within_its_own_budget(peaky, tmp_path, clock, monkeypatch):
    full = _recipe(tmp_path, "full", budget=1e9)
    pipeline.stage_data(full, peaky)
    want = _rows(full.out / "data" / "train.jsonl")
    r = _recipe(tmp_path, "killed", budget=1e9)
    real, calls = generate._row, {"n": 0}

    def row(*a):
        calls["n"] += 1
        if calls["n"] > 5:
            raise Killed
        return real(*a)

    monkeypatch.setattr(generate, "_row", row)
    with pytest.raises(Killed):
        pipeline.stage_data(r, peaky)
    monkeypatch.setattr(generate, "_row", real)
    assert not (r.out / "data" / "meta.json").exists()
    # re-run with a budget spent at once (the clock moves a second per reading): no crash, what was written
    # is kept, the rest counted
    tight = _recipe(tmp_path, "killed", budget=1e-6)
    monkeypatch.setattr(generate, "clock", itertools.count().__next__)
    pipeline.stage_data(tight, peaky)
    meta = _meta(tight)["time_budget"]
    assert meta["resumed"] == 5 and meta["written"] == 0 and meta["not_reached"] == meta["conversations"] - 5
    (tight.out / "data" / "meta.json").unlink()
    monkeypatch.undo()
    # and again with time: the rows an uninterrupted run writes, each once
    pipeline.stage_data(r, peaky)
    lines = (r.out / "data" / "train.jsonl").read_text().splitlines()
    assert len(lines) == len(want) and _rows(r.out / "data" / "train.jsonl") == want
    assert _meta(r)["time_budget"]["resumed"] == 5


def test_time_left_after_the_answers_goes_to_more_rounds_of_prompts_and_answers(peaky, tmp_path, clock, monkeypatch):
    """Answers faster than prompt writing leave budget unused after one round: the stage writes more Magpie
    prompts (the draws go on in order) and answers them, until less than a round's worth is left."""
    rich = _recipe(tmp_path, "rich", budget=1e9, n=2, magpie=60)
    pipeline.stage_data(rich, peaky)
    clock["now"] = 0.0
    r = _recipe(tmp_path, "rounds", budget=300.0, magpie_budget_share=0.3, n=2, magpie=60)
    pipeline.stage_data(r, peaky)
    meta = _meta(r)
    tb, gen = meta["time_budget"], meta["generation"]
    assert gen["data_rounds"] >= 2
    assert tb["magpie_prompts"]["stopped_by_budget"]
    prompts = (r.out / "data" / "magpie1.jsonl").read_text().splitlines()
    assert prompts == (rich.out / "data" / "magpie1.jsonl").read_text().splitlines()[:len(prompts)]
    assert tb["magpie_prompts"]["kept"] == len(prompts) == meta["sources"]["magpie_accepted"]
    rows = [json.loads(x)["id"] for x in (r.out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == len(set(rows)) == gen["conversations"] == tb["written"] == 2 + len(prompts)
    assert tb["not_reached"] == 0 and 300.0 - pipeline.MIN_ROUND_S <= tb["seconds_used"] <= 300.0 + 16
    # one round only: the same budget with rounds switched off (the minimum above the budget) writes fewer
    clock["now"] = 0.0
    one = _recipe(tmp_path, "one", budget=300.0, magpie_budget_share=0.3, n=2, magpie=60)
    monkeypatch.setattr(pipeline, "MIN_ROUND_S", 1e9)
    pipeline.stage_data(one, peaky)
    assert _meta(one)["generation"]["data_rounds"] == 1
    assert _meta(one)["time_budget"]["written"] < tb["written"]


def test_the_engine_compiles_before_the_budget_starts(peaky, tmp_path, clock, monkeypatch):
    """The fused step's graph is compiled before the budget's clock starts, so the budget buys generation: here a
    stand-in for the compiled step records the rows of each call, and the warm-up's decode step (1 s on the fake
    clock) is not in the seconds the budget counts. With a batch wider than 16 rows, steps of up to 16 (a graph of
    their own, `FastBatchBody.graph_rows`) run eagerly instead, so only the wide graph is compiled."""
    from draftsmith.engine.fast_batch import FastBatchBody
    from draftsmith.train.data import batchgen

    fb = FastBatchBody(peaky.model, compile=False)
    rows = []

    def compiled(ids, *a, **kw):
        rows.append(int(ids.shape[0]))
        return fb.core(ids, *a, **kw)

    fb.compiled = compiled
    monkeypatch.setattr(batchgen, "batch_body",
                        lambda model, mode, within_window=False: fb if mode == "compile" else None)
    assert fb.graph_rows(32) == [2, 17]
    r = _recipe(tmp_path, "warm", budget=1e9, max_rows=32, forward="compile")
    pipeline.stage_data(r, peaky)
    meta = _meta(r)
    assert meta["engine_compile"]["graphs"] == [17]
    # the warm-up's step first; the run's steps of up to 16 rows (its drains, down to one row) ran eagerly
    assert rows[0] == 17 and min(rows[1:]) > 16
    assert meta["time_budget"]["seconds_used"] == clock["now"] - 1
    # a batch of at most 16 rows compiles (and warms up) its one graph; an eager fused step warms nothing up
    assert batchgen.warm_up(peaky.model, "compile", 8)["graphs"] == [2] and rows[-1] == 2
    assert batchgen.warm_up(peaky.model, "fast", 32) == {"seconds": 0.0, "graphs": []}
