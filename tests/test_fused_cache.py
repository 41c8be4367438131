"""data.fused_cache: the training cache written from the generator's own states equals the separate pass's.

Every check compares with `build_cache` over the same train.jsonl (the separate pass), through the real
pipeline functions: token ids, masks, shard starts exactly; states within the stored dtype's rounding.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from draftsmith.pipeline import stages as pipeline
from draftsmith.common.hidden_cache import HiddenCache, field_file
from draftsmith.recipe import parse_recipe
from draftsmith.train.data import cache as cache_mod
from draftsmith.train.data.batchgen import BatchGenerator, Job
from draftsmith.train.data.cache import StreamingCacheWriter
from tests.tiny import make_tiny_target

WORDS = ["hello there", "tell me about cats", "why is the sky blue", "count to ten", "a poem please",
         "what is two plus two", "name a color", "say hi", "explain rain to a child", "list three fruits"]


@pytest.fixture(scope="module")
def peaky():
    tgt = make_tiny_target(init_std=0.5, seed=3)
    # <pad> and <|im_start|> also end a reply: decoding skips special tokens, so one generated mid-reply would
    # make the written text re-tokenise differently (the fallback, tested on purpose below, not by chance)
    tgt.model.generation_config.eos_token_id = [2, 0, 1]
    return tgt


def _recipe(tmp_path, name, n=30, turns=1, kind=None, data=None, cache=None, source=None):
    src = tmp_path / f"{name}-prompts.jsonl"
    if source is None:
        rows = [{"turns": [f"{WORDS[i % len(WORDS)]} {i}", f"and then {i}?"][:turns]} for i in range(n)]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse_recipe({
        "name": name, "output_dir": str(tmp_path / name), "seed": 0,
        "data": {"sources": [{"type": "jsonl", "path": str(source or src)}], "max_new_tokens": 40,
                 "max_turns": turns, "max_rows": 5, "max_seq_len": 400, "heldout_mtbench": False, **(data or {})},
        "cache": {"shard_tokens": 1000, "batch_tokens": 512, **(cache or {})},
        "drafter": kind or {"kind": "medusa", "num_heads": 2}})


def _separate(tmp_path, recipe, target, name):
    """The separate pass over the same train.jsonl (a copy of the data directory)."""
    other = parse_recipe({**recipe.model_dump(mode="json"), "name": name, "output_dir": str(tmp_path / name),
                          "data": {**recipe.data.model_dump(mode="json"), "fused_cache": False}})
    other.out.mkdir(parents=True)
    shutil.copytree(recipe.out / "data", other.out / "data")
    pipeline.stage_cache(other, target)
    return other.out / "cache" / "train"


def _assert_same_cache(a, b, tol):
    ia, ib = (json.loads((d / "index.json").read_text()) for d in (a, b))
    assert ia.keys() == ib.keys()
    for k in ("target_fingerprint", "needs", "dtype", "hidden_size", "shards", "sequences", "tokens", "loss_tokens",
              "bytes", "bytes_per_token"):
        assert ia[k] == ib[k], k
    assert ia["provenance"].keys() == ib["provenance"].keys()
    worst = 0.0
    for sh in ia["shards"]:
        for f in ("tokens", "mask", "starts"):
            assert np.array_equal(np.load(a / sh / f"{f}.npy"), np.load(b / sh / f"{f}.npy")), (sh, f)
        for nd in ia["needs"]:
            x, y = (np.load(d / sh / field_file(nd)) for d in (a, b))
            assert x.dtype == y.dtype and x.shape == y.shape
            if ia["dtype"] == "bfloat16":
                x, y = (torch.from_numpy(v.astype(np.int16)).view(torch.bfloat16).float().numpy() for v in (x, y))
            x, y = x.astype(np.float32), y.astype(np.float32)
            worst = max(worst, float(np.abs(x - y).max()))
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol)
    assert len(HiddenCache(a)) == ia["sequences"]
    return worst


def _run(recipe, target):
    pipeline.stage_data(recipe, target)
    meta = json.loads((recipe.out / "data" / "meta.json").read_text())
    return meta, pipeline.stage_cache(recipe, target)["train"]


def _count_forward(monkeypatch):
    """Rows the cache stage's normal forward computes."""
    seen = {"rows": 0}
    real = cache_mod.target_states

    def counting(target, ids, attn, needs):
        seen["rows"] += ids.shape[0]
        return real(target, ids, attn, needs)

    monkeypatch.setattr(cache_mod, "target_states", counting)
    return seen


# ---------------------------------------------------------------------------------------------- the engine
def test_engine_states_equal_a_forward_over_the_wanted_sequence(peaky):
    """States kept by the batched engine (prefill, decode steps, rows fed a tail or rewound) equal the states
    of one forward over the sequence the caller wanted; the generated tokens do not change."""
    model = peaky.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    budgets = [1, 5, 12, 20, 3, 17, 8, 25, 2, 14]
    cases = ["tail", "rewind", "same", "prefix", "retokenised", "over_capacity"]

    def wanted(job, out, fin):
        case = cases[job.key % len(cases)]
        seq = job.prompt + out
        return {"tail": seq + [5, 6, 2], "rewind": seq[:max(1, len(seq) - 3)] + [9, 9, 9, 9],
                "same": seq[:-1], "prefix": seq[:2], "retokenised": job.prompt[:1] + [95] * 12,  # prompts < 90
                "over_capacity": seq + [3] * 48}[case]

    plain, got = {}, {}
    BatchGenerator(model, {2, 7, 11}, max_rows=3, capacity=48).run(
        [Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))],
        lambda j, toks, fin: plain.__setitem__(j.key, (toks, fin)))
    gen = BatchGenerator(model, {2, 7, 11}, max_rows=3, capacity=48, keep_states=True, state_dtype=torch.float32,
                         max_feed=8)
    gen.run([Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))],
            lambda j, toks, fin, cap: got.__setitem__(j.key, (toks, fin, cap)), want=wanted)
    assert gen.stats["compactions"] > 0 and gen.stats["fed_tokens"] > 0
    reasons = set()
    for i, p in enumerate(prompts):
        toks, fin, cap = got[i]
        assert (toks, fin) == plain[i], f"job {i}"
        w = wanted(Job(i, p, budgets[i]), toks, fin)
        case = cases[i % len(cases)]
        if case in ("retokenised", "over_capacity"):
            assert cap.states is None and cap.reason == case, (i, cap)
            reasons.add(cap.reason)
            continue
        assert cap.reason is None and cap.states.shape == (len(w), peaky.hidden_size)
        with torch.no_grad():
            ref = model.model(input_ids=torch.tensor([w])).last_hidden_state[0]
        torch.testing.assert_close(cap.states, ref, atol=2e-5, rtol=1e-4)
    assert reasons == {"retokenised", "over_capacity"}


# ----------------------------------------------------------------------------------------- the pipeline
@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_fused_cache_equals_the_separate_pass(peaky, tmp_path, monkeypatch, dtype, tol):
    fused = _recipe(tmp_path, "fused", cache={"dtype": dtype})
    assert fused.data.fused_cache  # the default
    meta, idx = _run(fused, peaky)
    gen = meta["generation"]
    n = idx["sequences"]
    assert len(idx["shards"]) >= 3 and n == gen["conversations"] == 30
    assert gen["fused_from_generation"] == n and gen["fused_shards"] == len(idx["shards"])
    assert idx["provenance"]["states"] == {"from_generation": n, "forward": {}}
    # the data stage wrote every shard: the cache stage runs no forward at all
    seen = _count_forward(monkeypatch)
    (fused.out / "cache" / "train" / "index.json").unlink()
    again = pipeline.stage_cache(fused, peaky)["train"]
    assert seen["rows"] == 0 and again["provenance"]["states"]["from_generation"] == n
    monkeypatch.undo()
    worst = _assert_same_cache(fused.out / "cache" / "train", _separate(tmp_path, fused, peaky, "sep"), tol)
    assert worst > 0  # computed twice, not copied
    # the same data as a run without fusion (generation is unchanged by keeping states)
    plain = _recipe(tmp_path, "plain", cache={"dtype": dtype}, data={"fused_cache": False},
                    source=tmp_path / "fused-prompts.jsonl")
    meta_p, idx_p = _run(plain, peaky)
    assert (plain.out / "data" / "train.jsonl").read_text() == (fused.out / "data" / "train.jsonl").read_text()
    assert idx_p["provenance"]["states"] == {"from_generation": 0, "forward": {"cache_pass": n}}
    assert not any(k.startswith("fused_") for k in meta_p["generation"])


def test_multi_turn_conversations_are_fused_exactly(peaky, tmp_path):
    r = _recipe(tmp_path, "mt", n=16, turns=2)
    meta, idx = _run(r, peaky)
    rows = [json.loads(x) for x in (r.out / "data" / "train.jsonl").read_text().splitlines()]
    assert sum(len(x["finished"]) == 2 for x in rows) >= 3  # some conversations have two turns
    assert idx["provenance"]["states"]["from_generation"] == idx["sequences"]
    _assert_same_cache(r.out / "cache" / "train", _separate(tmp_path, r, peaky, "mt-sep"), 2e-3)


def test_retokenised_conversation_is_recomputed_and_counted(peaky, tmp_path, monkeypatch):
    """A reply whose written text re-tokenises away from the generated ids falls back to the forward
    (counted); one that differs only in its last token is rewound and fed instead (exact, counted)."""
    tok = peaky.tokenizer
    real = tok.decode
    calls = {"n": 0}

    def decode(ids, **kw):
        calls["n"] += 1
        text = real(ids, **kw)
        if calls["n"] == 1:
            return "Z" * 40 + text  # differs from its first token on: more than max_feed tokens to feed
        if calls["n"] == 2 and len(text) > 1:
            return text[:-1] + ("!" if text[-1] != "!" else "?")  # differs at its last character
        return text

    monkeypatch.setattr(tok, "decode", decode)
    r = _recipe(tmp_path, "retok")
    meta, idx = _run(r, peaky)
    monkeypatch.undo()
    gen = meta["generation"]
    n = idx["sequences"]
    assert gen["fused_fallback_retokenised"] == 1 and gen["fused_from_generation"] == n - 1
    assert gen["fused_rewound"] == 1 and gen["fused_fed_tokens"] > 0
    assert idx["provenance"]["states"] == {"from_generation": n - 1, "forward": {"retokenised": 1}}
    assert any("Z" * 40 in json.loads(x)["messages"][1]["content"]
               for x in (r.out / "data" / "train.jsonl").read_text().splitlines())
    _assert_same_cache(r.out / "cache" / "train", _separate(tmp_path, r, peaky, "retok-sep"), 2e-3)


class Killed(Exception):
    pass


@pytest.mark.parametrize("kill_at", [12, 19, None], ids=["mid-shard", "mid-second-shard", "after-generation"])
def test_kill_and_resume_gives_the_separate_pass_cache(peaky, tmp_path, monkeypatch, kill_at):
    """A data stage killed mid-way (its last line torn, its shard being filled lost) and resumed: the cache
    equals the separate pass over the final train.jsonl, which holds every conversation once and the same
    ones as an uninterrupted run; the conversations that lost their states got the forward."""
    full = _recipe(tmp_path, "full")
    _run(full, peaky)
    r = _recipe(tmp_path, "killed", source=tmp_path / "full-prompts.jsonl")
    if kill_at is not None:
        real = StreamingCacheWriter.add
        count = {"n": 0}

        def add(self, *a, **kw):
            count["n"] += 1
            if count["n"] > kill_at:
                raise Killed
            return real(self, *a, **kw)

        monkeypatch.setattr(StreamingCacheWriter, "add", add)
        with pytest.raises(Killed):
            pipeline.stage_data(r, peaky)
        monkeypatch.undo()
        path = r.out / "data" / "train.jsonl"
        text = path.read_text()
        path.write_text(text + text.splitlines(keepends=True)[-1][:25])  # a torn write after the last line
        assert list((r.out / "cache" / "train").glob(".fused-shard-*"))  # the shard being filled
    else:  # killed after generation (e.g. during the held-out answers): meta.json never written
        pipeline.stage_data(r, peaky)
        (r.out / "data" / "meta.json").unlink()
    meta, idx = _run(r, peaky)
    assert not list((r.out / "cache" / "train").glob(".fused-shard-*"))
    rows = [json.loads(x) for x in (r.out / "data" / "train.jsonl").read_text().splitlines()]
    ids = [x["id"] for x in rows]
    want = {json.loads(x)["id"]: json.loads(x) for x in (full.out / "data" / "train.jsonl").read_text().splitlines()}
    assert len(ids) == len(set(ids)) == len(want) and {x["id"]: x for x in rows} == want
    st = idx["provenance"]["states"]
    gen = meta["generation"]
    if kill_at is None:
        assert gen["resumed"] == len(want) and gen["fused_resumed_with_states"] > 0
        assert st == {"from_generation": len(want), "forward": {}}
    else:
        assert gen["torn_resume_lines"] == 1 and gen["resumed"] >= kill_at - 1
        lost = st["forward"]["resumed"]
        assert lost == gen["fused_fallback_resumed"] > 0 and st["from_generation"] + lost == len(want)
    _assert_same_cache(r.out / "cache" / "train", _separate(tmp_path, r, peaky, "killed-sep"), 2e-3)
    # and in the order the separate pass (and the trainer's calibration split) uses: the file's order
    c = HiddenCache(r.out / "cache" / "train")
    seqs = pipeline.load_sequences(r.out / "data" / "train.jsonl", peaky.tokenizer, r.data.max_seq_len)
    assert [c.tokens(i).tolist() for i in range(len(c))] == [s["ids"] for s in seqs]


@pytest.mark.parametrize("change,why", [
    ({"kind": {"kind": "kangaroo", "exit_layer": 1}}, "needs ['layer:1', 'final']"),
    ({"cache": {"extra_states": ["layer:1"]}}, "cache.extra_states"),
    ({"data": {"engine": "hf"}}, "only the batched engine"),
], ids=["kangaroo", "extra-states", "hf-engine"])
def test_other_needs_and_engines_fall_back_to_the_separate_pass(peaky, tmp_path, caplog, change, why):
    r = _recipe(tmp_path, "other", n=8, **change)
    with caplog.at_level("INFO", logger="draftsmith.pipeline.stages"):
        pipeline.stage_data(r, peaky)
    assert any("not fused" in m and why in m for m in caplog.messages), caplog.messages
    assert not list((r.out / "cache").glob("train/shard-*"))  # nothing written during generation
    meta = json.loads((r.out / "data" / "meta.json").read_text())
    assert not any(k.startswith("fused_") for k in meta["generation"])
    idx = pipeline.stage_cache(r, peaky)["train"]
    assert idx["provenance"]["states"] == {"from_generation": 0, "forward": {"cache_pass": idx["sequences"]}}
    assert idx["needs"] == pipeline.cache_needs(r)


@pytest.mark.real
def test_fused_cache_on_the_real_target(real_target, tmp_path):
    """SmolLM2's template ends a turn with '<|im_end|>' + newline: the newline is fed to the row; the
    fused cache equals the separate pass (states within fp16 rounding)."""
    from draftsmith.train.data.generate import FusedCacheWriter, regenerate
    from draftsmith.train.data.sources import SkipLog, read_sharegpt, resolve_path
    convs, seen = [], set()
    for c in read_sharegpt(resolve_path("builtin:sharegpt-dummy"), "sharegpt", SkipLog()):
        if c.user_turns[0] not in seen and len(convs) < 6:
            seen.add(c.user_turns[0])
            convs.append(c)
    st = regenerate(real_target, convs, tmp_path / "t.jsonl", max_new_tokens=24, max_turns=1, batch_size=6,
                    max_seq_len=2048, on_long_prompt="skip", engine="batched", max_rows=6,
                    fused=FusedCacheWriter(tmp_path / "fused"))
    seqs = pipeline.load_sequences(tmp_path / "t.jsonl", real_target.tokenizer, 2048)
    a = cache_mod.build_cache(real_target, seqs, ["final"], tmp_path / "fused")
    cache_mod.build_cache(real_target, seqs, ["final"], tmp_path / "sep")
    assert st["fused_fed_tokens"] > 0 and a["provenance"]["states"]["from_generation"] == len(seqs) == 6
    ca, cb = HiddenCache(tmp_path / "fused"), HiddenCache(tmp_path / "sep")
    for i in range(len(seqs)):
        assert ca.tokens(i).tolist() == cb.tokens(i).tolist() and ca.mask(i).tolist() == cb.mask(i).tolist()
        x, y = ca.states(i, "final"), cb.states(i, "final")
        assert bool(((x - y).abs() <= 2e-3 * y.abs() + 1e-2).all()), float((x - y).abs().max())


def test_heldout_answers_write_the_heldout_cache(peaky, tmp_path, monkeypatch):
    """The held-out MT-Bench answers' states come from their generation, as the training cache's do: the cache
    stage runs no forward for them, and the cache equals the separate pass's. A second run, whose held-out answers
    are read back from the shared file (generated once per target), gets them from the forward (counted)."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    held = {"heldout_mtbench": True, "heldout_max_new_tokens": 6}
    r = _recipe(tmp_path, "held", n=6, data=held)
    _run(r, peaky)
    idx = json.loads((r.out / "cache" / "heldout" / "index.json").read_text())
    n = len((r.out / "data" / "heldout.jsonl").read_text().splitlines())  # the prompts that fit the tiny context
    assert n > 40 and idx["sequences"] == n and idx["provenance"]["states"] == {"from_generation": n, "forward": {}}
    other = parse_recipe({**r.model_dump(mode="json"), "name": "held-sep", "output_dir": str(tmp_path / "held-sep"),
                          "data": {**r.data.model_dump(mode="json"), "fused_cache": False}})
    other.out.mkdir(parents=True)
    shutil.copytree(r.out / "data", other.out / "data")
    pipeline.stage_cache(other, peaky)
    _assert_same_cache(r.out / "cache" / "heldout", other.out / "cache" / "heldout", 2e-3)
    again = _recipe(tmp_path, "held2", n=6, data=held, source=tmp_path / "held-prompts.jsonl")
    _run(again, peaky)
    idx2 = json.loads((again.out / "cache" / "heldout" / "index.json").read_text())
    st = idx2["provenance"]["states"]
    assert st["from_generation"] == 0 and sum(st["forward"].values()) == n
    _assert_same_cache(again.out / "cache" / "heldout", other.out / "cache" / "heldout", 2e-3)
