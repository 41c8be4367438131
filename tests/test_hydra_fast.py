"""Compiled Hydra(++) drafting (heads/hydra/fast.py): the same numbers as the eager heads, frozen weights, and the
decoder's losslessness through it (greedy equality, exact enumeration)."""

import copy

import pytest
import torch

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.heads.decode import HeadDrafter
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.trees import DynamicTree
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from tests.test_decoder import tiny
from tests.test_hydra import random_hydra


@pytest.fixture(autouse=True)
def _drafting_in_the_heads_dtype(monkeypatch):
    """These tests compare compiled drafting's numbers with the eager heads': drafting in the heads' own dtype on
    every CPU (on one with native bf16, float32 heads would otherwise draft in bf16: `drafting_dtype`, tested
    below with the variable set back)."""
    monkeypatch.setenv("DRAFTSMITH_DRAFT_BF16", "0")


def _heads(tgt, vocab_keep=None, **kw):
    m = random_hydra(tgt, **kw)
    if vocab_keep:
        from draftsmith.heads.hydra.model import HydraHeads
        cfg = m.config.model_copy(update={"vocab_keep": vocab_keep})
        pruned = HydraHeads(cfg, tgt.lm_head, tgt.model.get_input_embeddings())
        pruned.load_state_dict(m.state_dict(), strict=False)
        pruned.set_draft_vocab(torch.arange(0, 2 * vocab_keep, 2))
        m = pruned.to(next(tgt.model.parameters()).dtype).eval()
    return m


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
@pytest.mark.parametrize("keep", [None, 8], ids=["full-vocab", "pruned"])
def test_depth_logits_equal_the_eager_heads(compiled, keep):
    tgt = tiny(vocab=20, seed=3, std=0.5)
    m = _heads(tgt, vocab_keep=keep, num_heads=3)
    fast = m.fast_drafting(compile=compiled, int8=False)
    d = HeadDrafter(m, tgt.fingerprint)
    base = torch.randn(1, tgt.hidden_size)
    for n, i in ((1, 1), (3, 2), (5, 3), (2, 3)):  # 3 and 5 rows are padded to the 4- and 8-row buckets
        paths = torch.randint(0, 20, (n, i))
        st, lg = fast.depth_logits(base, paths)
        ref_st = m.draft_states(base, paths)
        torch.testing.assert_close(st, ref_st, rtol=1e-5, atol=1e-5)
        ref = d._project(ref_st)
        if keep:  # pruned ids hold the dtype's minimum exactly (q = 0 there: lossless)
            out = torch.ones(20, dtype=torch.bool)
            out[m.draft_head.kept_ids] = False
            assert torch.all(lg[:, out] == torch.finfo(lg.dtype).min)
        torch.testing.assert_close(lg, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
def test_prefix_steps_equal_the_eager_layer(compiled):
    # A prompt of 7 rows (the 8-row bucket), then steps of 1, 3 and 2 rows,
    # then one that would run past the buffer's end in its bucket (eager over the same buffer): the base states
    # equal the eager layer's incremental ones.
    tgt = tiny(vocab=20, seed=4, std=0.5)
    m = _heads(tgt, num_heads=2, prefix=True)
    fast = m.fast_drafting(compile=compiled, int8=False)
    kv = fast.new_kv(16)
    h = torch.randn(15, tgt.hidden_size)
    past, start = None, 0
    for n in (7, 1, 3, 2, 2):  # the last: rows 13-14 in the 4-row bucket would reach slot 17 > 16
        got = fast.prefix_step(kv, h[start:start + n], start)
        ref, past = m.base_step(h[start:start + n], start, past)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        start += n
    with pytest.raises(ValueError, match="do not fit"):
        fast.prefix_step(kv, h[:2], 15)


def test_compiled_drafting_freezes_the_heads_weights():
    # Freezing applies to the drafter's graphs too: a weight changed after compiling leaves the compiled logits
    # unchanged, while the same function run eagerly sees the change (the check can fail).
    tgt = tiny(vocab=20, seed=5, std=0.5)
    m = _heads(tgt, num_heads=2)
    fast = m.fast_drafting(int8=False)
    base, paths = torch.randn(1, tgt.hidden_size), torch.tensor([[3]])
    before = fast.depth_logits(base, paths)[1]
    with torch.no_grad():
        m.heads[0].inp.weight.mul_(3.0)
    assert torch.equal(fast.depth_logits(base, paths)[1], before)
    assert (m.fast_drafting(compile=False, int8=False).depth_logits(base, paths)[1] - before).abs().max() > 1e-3


def test_a_copied_decode_state_gets_its_own_prefix_buffer():
    tgt = tiny(vocab=20, seed=6, std=0.5)
    use_fast_forward(tgt, "compile", autotune=False)
    dr = HeadDrafter(_heads(tgt, num_heads=2), tgt.fingerprint, name="hydra")
    dec = SpeculativeDecoder(tgt, dr, tree=[(0,), (1,), (0, 0)])
    st = dec.start([1, 2, 3, 4], 8)
    assert st.drafter_state.fast and st.drafter_state.kv is not None
    c = copy.copy(st.drafter_state)
    assert c.kv is not st.drafter_state.kv and c.kv.keys.data_ptr() != st.drafter_state.kv.keys.data_ptr()
    assert torch.equal(c.kv.keys, st.drafter_state.kv.keys)


_STATIC = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("prefix,tree", [(True, None), (True, _STATIC), (True, DynamicTree(8, 3, 3)), (False, _STATIC)],
                         ids=["hydra++-chain", "hydra++-static", "hydra++-dynamic", "hydra-static"])
def test_greedy_compiled_hydra_equals_plain(prefix, tree):
    t = tiny(vocab=10, seed=9, std=0.5)
    use_fast_forward(t, "compile", autotune=False)
    prompt = [1, 3, 4, 2, 5]
    plain = SpeculativeDecoder(t).generate(prompt, 40).tokens
    dr = HeadDrafter(random_hydra(t, prefix=prefix), t.fingerprint, name="hydra")
    res = SpeculativeDecoder(t, dr, tree=tree).generate(prompt, 40)
    assert dr._fast is not None and dr.compile_s > 0  # drafting really went through the compiled graphs
    assert res.tokens == plain
    assert res.tau > 1.1


@pytest.mark.parametrize("tree", [[(0,), (1,), (0, 0)], DynamicTree(budget=3, max_depth=2, width=2, expand_batch=1)],
                         ids=["static", "dynamic"])
def test_compiled_hydra_pp_trees_are_exact(tree):
    # Exact enumeration (tests/test_decoder_enumeration.py's bound for the compiled target forward: 1e-6)
    samp = SamplingParams(0.8)
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)
    use_fast_forward(tgt, "compile", autotune=False)
    prompt = [1, 3, 4, 3]
    ref = target_distribution(tgt, prompt, 3, samp.temperature, samp.top_k, samp.top_p)
    dr = HeadDrafter(random_hydra(tgt, num_heads=2, prefix=True).double(), tgt.fingerprint, name="hydra")
    got = exact_distribution(SpeculativeDecoder(tgt, dr, sampling=samp, tree=tree), prompt, 3)
    assert dr._fast is not None
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, ref) < 1e-6


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
def test_int8_drafting_stays_close_to_the_heads(compiled):
    # Weight-only int8 (the default on CPU): the same functions over quantised weights, within a few percent of
    # the logits' spread, and the same top candidate on most rows; the prefix layer's base states likewise.
    tgt = tiny(vocab=50, seed=7, std=0.5)
    m = _heads(tgt, vocab_keep=24, num_heads=2, prefix=True)
    q = m.fast_drafting(compile=compiled, int8=True)
    assert q.int8 and not m.fast_drafting(compile=False, int8=False).int8
    ref = m.fast_drafting(compile=False, int8=False)
    base, paths = torch.randn(1, tgt.hidden_size), torch.randint(0, 50, (6, 2))
    lq, lr = q.depth_logits(base, paths)[1], ref.depth_logits(base, paths)[1]
    kept = m.draft_head.kept_ids
    spread = lr[:, kept].std()
    assert (lq[:, kept] - lr[:, kept]).abs().max() < 0.1 * spread
    assert (lq.argmax(-1) == lr.argmax(-1)).float().mean() >= 0.8
    out = torch.ones(50, dtype=torch.bool)
    out[kept] = False
    assert torch.all(lq[:, out] == torch.finfo(lq.dtype).min)
    h = torch.randn(5, tgt.hidden_size)
    bq, br = q.prefix_step(q.new_kv(16), h, 0), ref.prefix_step(ref.new_kv(16), h, 0)
    assert (bq - br).abs().max() < 0.05 * br.abs().max()


def test_int8_drafting_is_exact_and_greedy_equal(monkeypatch):
    # Losslessness does not depend on the draft's numbers: exact enumeration through int8 drafting on a float32
    # target (TV within float32 rounding of the reference), and greedy equality with plain decoding. int8 is made
    # the default in float32 here (by default it is bf16/fp16's, where the CPU's int8 product is the faster one).
    import draftsmith.common.int8 as int8

    monkeypatch.setattr(int8, "INT8_DTYPES", (torch.float32,))
    samp = SamplingParams(0.8)
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float32)
    use_fast_forward(tgt, "compile", autotune=False)
    prompt = [1, 3, 4, 3]
    ref = target_distribution(tgt, prompt, 3, samp.temperature, samp.top_k, samp.top_p)
    dr = HeadDrafter(random_hydra(tgt, num_heads=2, prefix=True), tgt.fingerprint, name="hydra")
    got = exact_distribution(SpeculativeDecoder(tgt, dr, sampling=samp, tree=[(0,), (1,), (0, 0)]), prompt, 3)
    assert dr._fast is not None and dr._fast.int8
    assert total_variation(got, ref) < 1e-5
    t = tiny(vocab=10, seed=9, std=0.5)
    use_fast_forward(t, "compile", autotune=False)
    plain = SpeculativeDecoder(t).generate([1, 3, 4, 2, 5], 40).tokens
    dr = HeadDrafter(random_hydra(t, prefix=True), t.fingerprint, name="hydra")
    res = SpeculativeDecoder(t, dr, tree=_STATIC).generate([1, 3, 4, 2, 5], 40)
    assert dr._fast.int8 and res.tokens == plain and res.tau > 1.1


def test_int8_is_the_default_in_bf16_and_fp16_not_float32():
    """ATen's weight-only int8 product is the slower one in float32 on a CPU (docs/results-log.md section 38): drafting
    there keeps the dense weights unless asked."""
    from draftsmith.common.int8 import int8_by_default

    tgt = tiny(vocab=50, seed=7, std=0.5)
    m = _heads(tgt, vocab_keep=24, num_heads=2, prefix=True)
    assert not m.fast_drafting(compile=False).int8 and m.fast_drafting(compile=False, int8=True).int8
    assert int8_by_default(torch.zeros(1, dtype=torch.bfloat16))
    assert int8_by_default(torch.zeros(1, dtype=torch.float16))
    assert not int8_by_default(torch.zeros(1))


def test_float32_heads_draft_in_bf16_where_the_cpu_has_it_and_stay_lossless(monkeypatch):
    """On a CPU with native bf16 (made so here, whatever this one is), float32 heads draft through a bf16 copy
    (int8, as bf16 drafting does), the target's float32 states cast in and float32 logits out (the float32 minimum
    at pruned ids); the decoder stays exact (enumeration at T=0.8) and greedy-equal to plain decoding."""
    import draftsmith.common.int8 as int8

    monkeypatch.delenv("DRAFTSMITH_DRAFT_BF16")
    monkeypatch.setattr(int8, "native_bf16", lambda: True)
    tgt = tiny(vocab=20, seed=3, std=0.5)
    m = _heads(tgt, vocab_keep=8, num_heads=2, prefix=True)
    fast = m.fast_drafting(compile=False)
    assert fast.dtype == torch.bfloat16 and fast.int8 and next(m.parameters()).dtype == torch.float32
    assert m.fast_drafting(compile=False, dtype=torch.float32).dtype == torch.float32
    kv = fast.new_kv(16)
    base = fast.prefix_step(kv, torch.randn(3, tgt.hidden_size), 0)[-1:]
    assert kv.keys.dtype == torch.bfloat16 and base.dtype == torch.bfloat16
    st, lg = fast.depth_logits(base, torch.randint(0, 20, (3, 2)))
    out = torch.ones(20, dtype=torch.bool)
    out[m.draft_head.kept_ids] = False
    assert lg.dtype == torch.float32 and torch.all(lg[:, out] == torch.finfo(torch.float32).min)
    ref = m.fast_drafting(compile=False, int8=False, dtype=torch.float32).depth_logits(base.float(),
                                                                                        torch.randint(0, 20, (3, 2)))
    assert ref[1].dtype == torch.float32
    samp = SamplingParams(0.8)
    t = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float32)
    use_fast_forward(t, "compile", autotune=False)
    prompt = [1, 3, 4, 3]
    want = target_distribution(t, prompt, 3, samp.temperature, samp.top_k, samp.top_p)
    dr = HeadDrafter(random_hydra(t, num_heads=2, prefix=True), t.fingerprint, name="hydra")
    got = exact_distribution(SpeculativeDecoder(t, dr, sampling=samp, tree=[(0,), (1,), (0, 0)]), prompt, 3)
    assert dr._fast is not None and dr._fast.dtype == torch.bfloat16
    assert total_variation(got, want) < 1e-5
    g = tiny(vocab=10, seed=9, std=0.5)
    use_fast_forward(g, "compile", autotune=False)
    plain = SpeculativeDecoder(g).generate([1, 3, 4, 2, 5], 40).tokens
    dr = HeadDrafter(random_hydra(g, prefix=True), g.fingerprint, name="hydra")
    res = SpeculativeDecoder(g, dr, tree=_STATIC).generate([1, 3, 4, 2, 5], 40)
    assert dr._fast.dtype == torch.bfloat16 and res.tokens == plain and res.tau > 1.1
