"""The data engine's fused decode step (`draftsmith.engine.fast_batch`): same tokens and states as the model's own
forward, eager and compiled, for any batch size, with the native ragged attention inside."""

import logging

import pytest
import torch

from draftsmith.engine.fast_batch import FastBatchBody, batch_body
from draftsmith.engine.native import uses_native
from draftsmith.train.data import generate
from draftsmith.train.data.batchgen import BatchGenerator, Job
from draftsmith.train.data.sources import Conversation
from tests.tiny import greedy_reference as _reference, make_tiny_model, make_tiny_target
from tests.tiny import random_prompts as _prompts


@pytest.fixture(scope="module")
def wide():
    # head size 16 (a whole AVX-512 vector): the native kernel runs, not the masked fallback; grouped-query
    # attention (4 query heads over 2 key/value heads); a large init spreads logits so greedy has no near-ties
    return make_tiny_target(init_std=0.5, seed=11, hidden_size=64, heads=4, kv_heads=2)


def test_the_tiny_model_runs_the_native_kernel(wide):
    assert uses_native(torch.zeros(1, 4, 16))


@pytest.mark.parametrize("forward", ["fast", "compile"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_greedy_rows_equal_one_at_a_time(wide, rows, forward):
    model = wide.model
    eos = {2, 7, 11}  # rows end at very different steps: refills, compaction, and a batch that shrinks to 1 row
    prompts = _prompts(9, seed=1)
    budgets = [1, 5, 12, 20, 3, 17, 8, 25, 2]
    got = {}
    gen = BatchGenerator(model, eos, max_rows=rows, capacity=64, forward=forward)
    assert gen.forward == forward and gen.fast is batch_body(model, forward)
    gen.run([Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))],
            lambda j, toks, fin: got.__setitem__(j.key, (toks, fin)))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        assert got[i] == _reference(model, p, b, eos), f"job {i}"
    assert gen.stats["row_attention_steps"] == 0  # the model's own forward never ran a decode step


def test_the_fused_engine_never_reads_a_slot_it_did_not_write(wide):
    """Its cache is left unzeroed (`KVCache(zeroed=False)`): filled with NaN before the run, any read of an
    unwritten slot would poison a row's tokens."""
    model = wide.model
    eos = {2, 7, 11}
    prompts = _prompts(9, seed=3)
    budgets = [4, 15, 9, 22, 1, 13, 6, 19, 11]
    gen = BatchGenerator(model, eos, max_rows=4, capacity=64, forward="fast")
    cache = gen._ensure_cache()
    for layer in cache.layers:
        layer.keys.fill_(float("nan"))
        layer.values.fill_(float("nan"))
    got = {}
    gen.run([Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))],
            lambda j, toks, fin: got.__setitem__(j.key, (toks, fin)))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        assert got[i] == _reference(model, p, b, eos), f"job {i}"
    eager = BatchGenerator(model, eos, max_rows=4, capacity=64, forward="eager")
    assert all(not t.any() for layer in eager._ensure_cache().layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("forward", ["fast", "compile"])
def test_kept_states_equal_the_models_own_forward(wide, forward):
    """The fused cache's states come from this step: they equal the model's forward's (fp32 tolerance) at
    every position, prompts of very different lengths in flight together."""
    model = wide.model
    prompts = [p * 3 for p in _prompts(6, seed=4)]
    caps = {}
    for fwd in ("eager", forward):
        gen = BatchGenerator(model, set(), max_rows=6, capacity=160, keep_states=True, state_dtype=torch.float32,
                             attention="masked", forward=fwd)
        got = {}
        gen.run([Job(i, p, 12) for i, p in enumerate(prompts)],
                lambda j, toks, fin, cap: got.__setitem__(j.key, (toks, cap)),
                want=lambda j, toks, fin: j.prompt + toks)
        caps[fwd] = got
    for i in range(len(prompts)):
        assert caps[forward][i][0] == caps["eager"][i][0]
        _close_to_row_scale(caps[forward][i][1].states, caps["eager"][i][1].states)


def _close_to_row_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 states of two forwards that sum in other orders (inductor's kernels are picked by timing, and
    differ by CPU): each element within 2^-13 of its row's largest state. Measured: up to 6.3e-6 of the row's
    scale (1.5e-5 absolute on states of magnitude 2-4) on an AVX2-only EPYC, about 50 float32 ulps; a state from
    another position or a stale cache entry is off by the states' own magnitude."""
    tol = 2.0 ** -13 * want.abs().amax(-1, keepdim=True)
    bad = (got - want).abs() > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements differ by more than 2^-13 of their row's "
                           f"scale; largest difference {float((got - want).abs().max()):.3g}")


@pytest.mark.parametrize("forward", ["fast", "compile"])
def test_shared_prefix_and_flat_prefill_keep_tokens_and_states(wide, forward):
    """Prompts of one system prompt: the fused step prefills each group as one flat run after the copied prefix;
    tokens equal one-at-a-time greedy, states equal the model's own forward without sharing."""
    model = wide.model
    prefix = torch.randint(3, 90, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    prompts = [prefix + p for p in _prompts(7, seed=5)] + [prefix[:5] + [4, 4]]  # the last shares only 5 tokens
    eos = {2, 7}
    got = {}
    for fwd, share in ((forward, True), ("eager", False)):
        gen = BatchGenerator(model, eos, max_rows=3, capacity=80, keep_states=True, state_dtype=torch.float32,
                             shared_prefix=share, forward=fwd)
        res = {}
        gen.run([Job(i, p, 10) for i, p in enumerate(prompts)],
                lambda j, toks, fin, cap: res.__setitem__(j.key, (toks, fin, cap)),
                want=lambda j, toks, fin: j.prompt + toks)
        got[fwd if share else "ref"] = res
        assert (gen.stats["prefix_tokens_reused"] > 0) == share
    for i, p in enumerate(prompts):
        toks, fin, cap = got[forward][i]
        assert (toks, fin) == _reference(model, p, 10, eos), f"job {i}"
        # fp32 accumulation order: inductor's fused kernels sum in another order than eager (states ~1-10 here)
        torch.testing.assert_close(cap.states, got["ref"][i][2].states, atol=1e-4, rtol=1e-4)


def test_one_compiled_graph_serves_every_batch_size(wide):
    body = batch_body(wide.model, "compile")
    gen = BatchGenerator(wide.model, {2, 7}, max_rows=7, capacity=48, forward="compile")
    gen.run([Job(i, p, 9) for i, p in enumerate(_prompts(12, seed=9))], lambda *a: None)
    before = body.compiles
    for rows, cap in ((5, 48), (2, 48), (7, 96), (1, 48)):  # other batch sizes, another capacity, a 1-row cache
        BatchGenerator(wide.model, {2, 7}, max_rows=rows, capacity=cap, forward="compile").run(
            [Job(i, p, 9) for i, p in enumerate(_prompts(5, seed=rows))], lambda *a: None)
    assert body.compiles == before, f"recompiled {body.compiles - before} times"
    assert body.compile_s > 0


def test_one_compiled_graph_serves_every_batch_size_with_a_rope_per_layer_type():
    """Gemma 3 (a RoPE per layer type: cos/sin [types, rows, 1, dim]) within its window: the batch size is the
    rotary tables' second dimension, marked dynamic there. Marked at the first, the server compiled a second graph
    for 8 rows in the middle of a burst (25 s on a Zen 4 EPYC)."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.fastpath import use_fast_forward
    from tests.families import family_target
    tgt = family_target("gemma3", window=64)
    use_fast_forward(tgt, "compile", autotune=False)
    dec = BatchedSpeculativeDecoder(tgt, None)
    cap = dec.call_capacity(dec.positions(12, 8), 2048)
    assert cap == 64
    dec.warmup([1, 5, 6, 7], 4, 8, cap)
    body = batch_body(tgt.model, "compile", within_window=True)
    before = body.compiles
    assert before >= 1
    for rows in (8, 5, 3):
        dec.generate([[1, 5 + r, 6, 7] for r in range(rows)], [8] * rows, max_rows=8, capacity=cap)
    assert body.compiles == before, f"recompiled {body.compiles - before} times"


def test_sampling_draws_the_same_tokens_as_the_models_own_forward(wide):
    """Each row samples from its own seeded generator: with the same logits (to fp32 rounding, no draw near a
    CDF boundary at this init) the fused step draws what the model's forward draws."""
    outs = {}
    for fwd in ("eager", "fast"):
        got = {}
        BatchGenerator(wide.model, {2}, max_rows=4, capacity=64, temperature=0.8, top_p=0.95, forward=fwd).run(
            [Job(i, p, 10, seed=100 + i) for i, p in enumerate(_prompts(7, seed=3))],
            lambda j, toks, fin: got.__setitem__(j.key, toks))
        outs[fwd] = got
    assert outs["fast"] == outs["eager"]


def test_regenerate_passes_the_forward_through(wide, tmp_path):
    convs = [Conversation(f"c{i}", "t", [f"question {i} " * (i + 1)]) for i in range(6)]
    lines = {}
    for fwd in ("eager", "fast"):
        out = tmp_path / f"{fwd}.jsonl"
        st = generate.regenerate(wide, convs, out, max_new_tokens=10, max_turns=1, batch_size=4, max_seq_len=256,
                                 max_rows=4, forward=fwd)
        assert st["response_tokens"] > 0
        lines[fwd] = out.read_text()
    assert lines["fast"] == lines["eager"]


def test_eager_or_an_unsupported_model_keeps_the_models_forward(caplog):
    m = make_tiny_model(hidden_size=64, heads=4, kv_heads=2, seed=2)
    assert batch_body(m, "eager") is None
    m.config.hidden_act = "gelu"
    with caplog.at_level(logging.WARNING):
        assert batch_body(m, "compile") is None
    assert "hidden_act 'gelu'" in caplog.text
    assert BatchGenerator(m, {2}, forward="compile").forward == "eager"
    with pytest.raises(ValueError, match="decoding forward must be one of"):
        batch_body(m, "turbo")
    with pytest.raises(ValueError, match="does not support this model"):
        FastBatchBody(m)


def test_the_batched_step_runs_on_the_single_decoders_weights():
    """With our forward on a target (`use_fast_forward`), the batched step (data engine, batched decoder) runs on
    the single-sequence `FastBody`'s fused weights: one copy in memory, one step function."""
    from draftsmith.engine.fastpath import use_fast_forward
    t = make_tiny_target(seed=5)
    use_fast_forward(t, "fast")
    assert batch_body(t.model, "fast").core is t.fast_body.core


def test_graph_rows_name_each_compiled_regime():
    """The row counts a server warms up: 2, and past the native products' row limit the first count that
    multiplies by BLAS (its own graph); nothing more for an eager body."""
    from draftsmith.engine.native import ROWS_LINEAR_MAX
    m = make_tiny_model(hidden_size=64, heads=4, kv_heads=2, seed=3)
    fb = FastBatchBody(m, compile=True)
    assert fb.graph_rows(8) == [2] and fb.graph_rows(1) == [1]
    assert fb.graph_rows(32) == ([2, ROWS_LINEAR_MAX + 1] if fb.core.rows_native else [2])
    assert FastBatchBody(m, compile=False).graph_rows(32) == [2]


@pytest.mark.real
def test_real_target_fast_step_writes_what_the_models_forward_writes(real_target, tmp_path):
    """SmolLM2 in float32, 8 MT-Bench first turns x 48 tokens, greedy: the fused step (eager: the compiled graph
    is the same function, checked above on the tiny model) gives the same responses as the model's forward."""
    from draftsmith.train.data.sources import mtbench_questions
    convs = [Conversation(f"mt{q['question_id']}", "mtbench", [q["turns"][0]]) for q in mtbench_questions()[:8]]
    lines = {}
    for fwd in ("eager", "fast"):
        out = tmp_path / f"{fwd}.jsonl"
        generate.regenerate(real_target, convs, out, max_new_tokens=48, max_turns=1, batch_size=8, max_seq_len=1024,
                            max_rows=8, forward=fwd)
        lines[fwd] = sorted(out.read_text().splitlines())
    assert lines["fast"] == lines["eager"]
