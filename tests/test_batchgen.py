"""The continuous-batching data path: same tokens as one-at-a-time greedy, exact resume, counted skips."""

import json

import pytest
import torch

from draftsmith.train.data import generate
from draftsmith.engine.sampling import inverse_cdf_rows, pick_tokens
from draftsmith.train.data.batchgen import BatchGenerator, Job
from draftsmith.engine.kvcache import KVCache
from draftsmith.train.data.sources import Conversation
from tests.tiny import greedy_reference as _reference, make_tiny_target, random_prompts as _prompts


@pytest.fixture(scope="module")
def peaky():
    # a larger init spreads the logits, so fp32 accumulation order cannot create ties
    return make_tiny_target(init_std=0.5, seed=3)


@pytest.mark.parametrize("attention", ["masked", "rows"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_greedy_rows_equal_one_at_a_time(peaky, rows, attention):
    model = peaky.model
    eos = {2, 7, 11}  # frequent stops: rows end at very different steps, so refills and compaction happen
    prompts = _prompts(9)
    budgets = [1, 5, 12, 20, 3, 17, 8, 25, 2]
    got = {}
    gen = BatchGenerator(model, eos, max_rows=rows, capacity=64, attention=attention)
    gen.run([Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))],
            lambda j, toks, fin: got.__setitem__(j.key, (toks, fin)))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        assert got[i] == _reference(model, p, b, eos), f"job {i}"
    assert gen.stats["generated_tokens"] == sum(len(v[0]) for v in got.values())
    if rows == 3:
        assert gen.stats["compactions"] > 0  # the hole-filling path was exercised
    assert (gen.stats["row_attention_steps"] == gen.stats["forwards"] > 0) == (attention == "rows")
    assert model.config._attn_implementation != "draftsmith_ragged"  # switched back after every step


def test_row_attention_keeps_the_same_states_as_the_masked_step(peaky):
    """Per-row attention reads each row's own slots [0, length]: the kept final states equal the masked
    call's (fp32 tolerance) at every position, prompts of very different lengths in flight together."""
    model = peaky.model
    prompts = [p * 3 for p in _prompts(6, seed=4)]  # lengths ~6..90: the masked call pads most rows a lot
    caps = {}
    for attention in ("masked", "rows"):
        gen = BatchGenerator(model, set(), max_rows=6, capacity=160, keep_states=True, state_dtype=torch.float32,
                             attention=attention)
        got = {}
        gen.run([Job(i, p, 12) for i, p in enumerate(prompts)],
                lambda j, toks, fin, cap: got.__setitem__(j.key, (toks, cap)),
                want=lambda j, toks, fin: j.prompt + toks)
        caps[attention] = got
    for i in range(len(prompts)):
        assert caps["rows"][i][0] == caps["masked"][i][0]
        a, b = caps["rows"][i][1].states, caps["masked"][i][1].states
        assert a.shape == b.shape == (len(prompts[i]) + 12, model.config.hidden_size)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_row_attention_rule_and_bad_mode(peaky):
    gen = BatchGenerator(peaky.model, set(), max_rows=4, capacity=64, row_attention_gap=100)
    assert gen.row_attention([10, 400], 401)       # mean 205: 196 masked slots a row past the mean
    assert not gen.row_attention([300, 310], 311)  # similar lengths: one masked call
    assert BatchGenerator(peaky.model, set(), attention="rows").row_attention([5, 5], 6)
    assert not BatchGenerator(peaky.model, set(), attention="masked").row_attention([1, 900], 901)
    with pytest.raises(ValueError, match="unknown decode attention 'fast'"):
        BatchGenerator(peaky.model, set(), attention="fast")


def test_follow_up_jobs_run_and_zero_budget_jobs_end_at_once(peaky):
    seen = []

    def on_done(job, toks, fin):
        seen.append((job.key, len(toks)))
        if job.key == "a":
            return [Job("a2", job.prompt + toks, 4)]
        return None

    gen = BatchGenerator(peaky.model, {2}, max_rows=2, capacity=64)
    gen.run([Job("a", [5, 6, 7], 3), Job("z", [5], 0), Job("b", [9, 9], 2)], on_done)
    assert {k for k, _ in seen} == {"a", "a2", "z", "b"}
    assert dict(seen)["z"] == 0


def test_sampling_depends_on_the_job_seed_not_the_batch(peaky):
    prompts = _prompts(6, seed=1)
    res = []
    for rows in (1, 4):
        got = {}
        gen = BatchGenerator(peaky.model, {2}, max_rows=rows, capacity=64, temperature=1.0, top_p=0.9)
        gen.run([Job(i, p, 10, seed=100 + i) for i, p in enumerate(prompts)],
                lambda j, toks, fin: got.__setitem__(j.key, toks))
        res.append(got)
    assert res[0] == res[1]
    other = {}
    BatchGenerator(peaky.model, {2}, max_rows=4, capacity=64, temperature=1.0).run(
        [Job(i, p, 10, seed=999 + i) for i, p in enumerate(prompts)],
        lambda j, toks, fin: other.__setitem__(j.key, toks))
    assert other != res[0]  # the seed matters


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.05, 0.9, 0.05], [0.3, 0.3, 0.4]]))

    class R:
        gen = torch.Generator().manual_seed(0)

    draws = [pick_tokens(logits, [R(), R()], 1.0, 0.85) for _ in range(50)]
    assert all(d[0] == 1 for d in draws)  # 0.9 alone reaches 0.85
    assert {d[1] for d in draws} <= {0, 1, 2} and len({d[1] for d in draws}) > 1


def test_job_longer_than_capacity_is_a_clear_error(peaky):
    gen = BatchGenerator(peaky.model, {2}, max_rows=2, capacity=16)
    with pytest.raises(ValueError, match="capacity 16"):
        gen.run([Job("long", list(range(3, 15)), 8)], lambda *a: None)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.run([Job("e", [], 8)], lambda *a: None)


def test_kv_memory_estimate_matches_the_allocation(peaky):
    cfg = peaky.model.config
    cache = KVCache(cfg, 40, torch.float32, "cpu", rows=3)
    allocated = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in cache.layers)
    assert KVCache.bytes_needed(cfg, 3, 40, torch.float32) == allocated


def _convs(n):
    words = ["hello there", "tell me about cats", "why is the sky blue", "count to ten", "a poem please",
             "what is two plus two", "name a color", "say hi", "explain rain to a child"]
    return [Conversation(id=f"c{i}", source="t", user_turns=[words[i % len(words)] + f" {i}", "and more?"])
            for i in range(n)]


def test_batched_engine_writes_what_the_hf_engine_writes(peaky, tmp_path):
    convs = _convs(7)
    kw = dict(max_new_tokens=12, max_turns=2, batch_size=3, max_seq_len=256)
    s_hf = generate.regenerate(peaky, convs, tmp_path / "hf.jsonl", engine="hf", **kw)
    s_b = generate.regenerate(peaky, convs, tmp_path / "b.jsonl", engine="batched", max_rows=4, **kw)
    hf = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "hf.jsonl").read_text().splitlines()}
    b = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()}
    assert hf == b
    for k in ("conversations", "responses", "response_tokens", "unfinished_responses"):
        assert s_hf[k] == s_b[k], k


def test_resume_after_a_kill_mid_write_has_no_duplicates_and_loses_nothing(peaky, tmp_path):
    convs = _convs(8)
    kw = dict(max_new_tokens=10, max_turns=1, batch_size=4, max_seq_len=256, engine="batched", max_rows=3)
    full = tmp_path / "full.jsonl"
    generate.regenerate(peaky, convs, full, **kw)
    lines = full.read_text().splitlines(keepends=True)
    # the state a kill -9 leaves: some whole lines, then half of the next one
    part = tmp_path / "part.jsonl"
    part.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    stats = generate.regenerate(peaky, convs, part, **kw)
    assert stats["torn_resume_lines"] == 1 and stats["resumed"] == 3
    rows = [json.loads(x) for x in part.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(convs)
    assert {r["id"]: r for r in rows} == {json.loads(x)["id"]: json.loads(x) for x in lines}
    # nothing left to do: a third run writes nothing
    again = generate.regenerate(peaky, convs, part, **kw)
    assert again["resumed"] == len(convs) and again["conversations"] == 0
    assert len(part.read_text().splitlines()) == len(convs)


def test_long_prompts_skipped_and_counted_or_a_clear_error(peaky, tmp_path):
    convs = _convs(3) + [Conversation(id="huge", source="t", user_turns=["x" * 400])]
    kw = dict(max_new_tokens=8, max_turns=1, batch_size=4, max_seq_len=128, engine="batched")
    stats = generate.regenerate(peaky, convs, tmp_path / "a.jsonl", on_long_prompt="skip", **kw)
    assert stats["skipped_long_prompt"] == 1 and stats["conversations"] == 3
    with pytest.raises(generate.PromptTooLongError, match="huge"):
        generate.regenerate(peaky, convs, tmp_path / "b.jsonl", on_long_prompt="error", **kw)


def test_magpie_batched_prompts_do_not_depend_on_rows(peaky):
    a, sa = generate.synthesize_prompts(peaky, 4, max_new_tokens=16, seed=5, min_chars=1, max_rows=2)
    b, sb = generate.synthesize_prompts(peaky, 4, max_new_tokens=16, seed=5, min_chars=1, max_rows=7)
    assert [c.user_turns for c in a] == [c.user_turns for c in b]
    assert sa == sb


@pytest.mark.parametrize("engine", ["batched", "hf"])
def test_magpie_openers_start_each_draws_prompt(peaky, engine):
    openers = ["Solve", "Write a", ""]
    got, _ = generate.synthesize_prompts(peaky, 9, max_new_tokens=12, seed=5, min_chars=1, max_rows=4,
                                         openers=openers, engine=engine, batch_size=4)
    assert len(got) >= 6  # (the hf path gives up after a fixed number of batches of unfinished draws)
    starts = [next((o for o in openers[:2] if c.user_turns[0].startswith(o)), "") for c in got]
    assert {"Solve", "Write a"} <= set(starts)  # every steered draw starts with its opener
    steered, _ = generate.synthesize_prompts(peaky, 9, max_new_tokens=12, seed=5, min_chars=1, max_rows=4,
                                             openers=["Solve"], engine=engine, batch_size=4)
    assert steered and all(c.user_turns[0].startswith("Solve") for c in steered)
    plain, _ = generate.synthesize_prompts(peaky, 9, max_new_tokens=12, seed=5, min_chars=1, max_rows=4,
                                           engine=engine, batch_size=4)
    assert sum(c.user_turns[0].startswith("Solve") for c in plain) < len(plain)
    assert generate.resolve_openers("builtin:tasks") == list(generate.TASK_OPENERS)
    for bad in ("Solve", [], [3]):
        with pytest.raises(ValueError, match="openers"):
            generate.resolve_openers(bad)


def test_unknown_engine_is_a_clear_error(peaky, tmp_path):
    with pytest.raises(ValueError, match="unknown generation engine 'vllm'"):
        generate.regenerate(peaky, _convs(1), tmp_path / "x.jsonl", max_new_tokens=4, max_turns=1, batch_size=1,
                            max_seq_len=64, engine="vllm")


def test_magpie_resumes_from_saved_rounds(peaky):
    kw = dict(max_new_tokens=16, seed=5, min_chars=1, max_rows=3, round_size=4)
    full, _ = generate.synthesize_prompts(peaky, 9, **kw)
    saved = {"prompts": [], "draws": 0}

    class Killed(Exception):
        pass

    def save_then_die(new, draws):
        saved["prompts"] += new
        saved["draws"] = draws
        if saved["prompts"]:
            raise Killed  # a kill right after the first round that kept a prompt was saved

    with pytest.raises(Killed):
        generate.synthesize_prompts(peaky, 9, on_round=save_then_die, **kw)
    assert 0 < len(saved["prompts"]) < 9 and saved["draws"] % 4 == 0
    resumed, _ = generate.synthesize_prompts(peaky, 9, done=saved["prompts"], draws_done=saved["draws"], **kw)
    assert [c.user_turns for c in resumed] == [c.user_turns for c in full]
    assert [c.id for c in resumed] == [c.id for c in full]


def _nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The most probable tokens, in order, until their mass reaches top_p; then every token tied with the last."""
    keep = torch.zeros_like(p, dtype=torch.bool)
    cum = 0.0
    for i in p.argsort(descending=True).tolist():
        keep[i] = True
        cum += float(p[i])
        if cum >= top_p - 1e-9:
            return keep | (p == p[i])
    return keep


@pytest.mark.parametrize("p,top_p", [
    ([0.05, 0.3, 0.02, 0.25, 0.2, 0.1, 0.08], 1.0),
    ([0.05, 0.3, 0.02, 0.25, 0.2, 0.1, 0.08], 0.8),
    ([0.05, 0.3, 0.02, 0.25, 0.2, 0.1, 0.08], 0.3),  # a nucleus of one token
    ([0.4, 0.2, 0.2, 0.2], 0.5),  # the boundary token has two ties: all three kept
    ([0.001] * 1000 + [0.0005] * 2000, 0.9),  # a wide nucleus over several blocks, ties at the boundary
])
def test_sampler_draws_the_nucleus_distribution(p, top_p):
    from scipy.stats import chisquare

    p = torch.tensor(p, dtype=torch.float64)
    p = p / p.sum()
    keep = _nucleus(p, top_p)
    want = torch.where(keep, p, torch.zeros_like(p))
    want = want / want.sum()

    class R:
        gen = torch.Generator().manual_seed(11)

    rows = [R() for _ in range(50)]
    logits = torch.log(p).float()[None].expand(50, -1)
    counts = torch.zeros(len(p))
    for _ in range(80):
        for t in pick_tokens(logits, rows, 1.0, top_p):
            counts[t] += 1
    assert counts[~keep].sum() == 0  # never outside the nucleus
    if keep.sum() == 1:
        return
    if len(p) > 100:  # compare masses of the two probability levels (cells of 1-2 expected counts are no test)
        hi = p == p.max()
        obs = [counts[keep & hi].sum(), counts[keep & ~hi].sum()]
        exp = [want[keep & hi].sum() * counts.sum(), want[keep & ~hi].sum() * counts.sum()]
        assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)
        return
    n = counts.sum()
    stat = chisquare(counts[keep].numpy(), (want[keep] * n).numpy())
    assert stat.pvalue > 1e-3, (counts, want)


def test_the_inverse_cdf_reaches_every_token_at_its_boundaries():
    """Uniforms just past the CDF's steps land on the token whose interval they open (blocks of 4 over 10
    tokens; "just past": 1e-6, above the float32 rounding of a block's mass)."""
    p = torch.tensor([[0.1, 0.0, 0.2, 0.05, 0.05, 0.3, 0.0, 0.1, 0.1, 0.1]])
    cdf = p[0].double().cumsum(0)
    for tok in range(10):
        if p[0, tok] == 0:
            continue
        lo = 0.0 if tok == 0 else float(cdf[tok - 1])
        for u in (lo + 1e-6, (lo + float(cdf[tok])) / 2):
            assert int(inverse_cdf_rows(p, torch.tensor([u], dtype=torch.float64), block=4)[0]) == tok, (tok, u)


def _with_prefix(prompts, prefix):
    return [prefix + p for p in prompts]


@pytest.mark.parametrize("forward", ["eager", "fast"])
@pytest.mark.parametrize("rows", [2, 16])
def test_shared_prefix_prefill_gives_the_same_tokens_and_states(peaky, rows, forward):
    """Prompts that start with one system prompt: the prefix is computed once and copied into each row;
    tokens equal one-at-a-time greedy decoding, kept states equal a run without sharing (fp32 tolerance)."""
    model = peaky.model
    prefix = torch.randint(3, 90, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    prompts = _with_prefix(_prompts(7, seed=5), prefix) + [prefix[:5] + [4, 4]]  # the last shares only 5 tokens
    eos = {2, 7}
    got = {}
    for share in (True, False):
        gen = BatchGenerator(model, eos, max_rows=rows, capacity=80, keep_states=True, state_dtype=torch.float32,
                             shared_prefix=share, forward=forward)
        res = {}
        gen.run([Job(i, p, 10) for i, p in enumerate(prompts)],
                lambda j, toks, fin, cap: res.__setitem__(j.key, (toks, fin, cap)),
                want=lambda j, toks, fin: j.prompt + toks)
        got[share] = res
        assert (gen.stats["prefix_tokens_reused"] > 0) == share
    for i, p in enumerate(prompts):
        toks, fin, cap = got[True][i]
        assert (toks, fin) == _reference(model, p, 10, eos), f"job {i}"
        assert toks == got[False][i][0]
        torch.testing.assert_close(cap.states, got[False][i][2].states, atol=1e-5, rtol=1e-5)


def test_shared_prefix_is_never_a_whole_prompt(peaky):
    """One job (its whole prompt is the 'common prefix'): the row still prefills its last prompt token."""
    gen = BatchGenerator(peaky.model, set(), max_rows=2, capacity=40)
    p = _prompts(1, seed=9)[0] + [5, 6, 7]
    got = {}
    gen.run([Job(0, p, 6)], lambda j, toks, fin: got.__setitem__(0, (toks, fin)))
    assert got[0] == _reference(peaky.model, p, 6, set())
    assert gen.stats["prefix_tokens_reused"] == len(p) - 1


def test_another_threads_forward_during_a_row_attention_step_is_plain_sdpa(peaky):
    """The model's attention name is switched during a per-row step; a forward on another thread meanwhile
    (2D mask, so masks are built from the name) gives exactly what it gives under plain SDPA."""
    import threading as th
    from draftsmith.train.data.row_attention import RAGGED_ATTENTION
    model = peaky.model
    ids = torch.tensor([_prompts(1, seed=11)[0] * 2])
    am = torch.ones_like(ids)
    am[0, :2] = 0  # left padding: the mask must be built (an all-ones mask may be skipped)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).logits
    before = model.config._attn_implementation
    model.config._attn_implementation = RAGGED_ATTENTION  # as during `row_attention`
    try:
        got = {}
        t = th.Thread(target=lambda: got.setdefault("x", model(input_ids=ids, attention_mask=am).logits))
        with torch.no_grad():
            t.start()
            t.join()
    finally:
        model.config._attn_implementation = before
    torch.testing.assert_close(got["x"].detach(), want, atol=1e-6, rtol=1e-6)


def test_admitting_rows_in_groups_keeps_the_tokens_and_saves_prefills(peaky):
    """Rows that end one at a time are refilled once `admit_rows` are free: fewer prefill forwards, same tokens."""
    eos = {2, 7, 11}
    jobs = [Job(i, p, b) for i, (p, b) in enumerate(zip(_prompts(30, seed=6), [3, 9, 14, 5, 20, 2] * 5))]
    out, prefills = {}, {}
    for admit in (1, 4):
        got = {}
        gen = BatchGenerator(peaky.model, eos, max_rows=8, capacity=64, admit_rows=admit)
        gen.run(list(jobs), lambda j, toks, fin: got.__setitem__(j.key, (toks, fin)))
        out[admit], prefills[admit] = got, gen.stats["prefill_forwards"]
    assert out[4] == out[1] and len(out[4]) == 30
    assert prefills[4] < prefills[1]
    assert BatchGenerator(peaky.model, eos, max_rows=96).admit_rows == 8
