"""Compiled EAGLE-3 drafting (drafters/eagle3/fast.py): the eager drafter's numbers, its own buffer per decode
state, and the decoder's losslessness through it (exact enumeration: chain, static and dynamic trees; greedy
equality with plain decoding), with the drafter's weights and with int8 ones."""

import copy

import pytest
import torch

from draftsmith.drafters.eagle3.fast import FastEagle3
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.trees import DynamicTree, StaticTree
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP
from tests.test_eagle3 import PROMPT, module

STATIC = StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
TREES = [None, STATIC, DynamicTree(budget=6, max_depth=3, width=2, expand_batch=2)]
IDS = ["chain", "static", "dynamic"]


@pytest.fixture(autouse=True)
def _drafting_in_the_modules_dtype(monkeypatch):
    """These tests compare compiled drafting's numbers with the eager drafter's: drafting in the module's own dtype
    on every CPU (on one with native bf16 a float32 module would otherwise draft in bf16: `drafting_dtype`, tested
    below with the variable unset)."""
    monkeypatch.setenv("DRAFTSMITH_DRAFT_BF16", "0")


def recording(dr):
    """Keep every (start, end, logits) the drafter proposes."""
    seen = []
    inner = dr.propose

    def propose(dec, state, tree, start, end):
        out = inner(dec, state, tree, start, end)
        seen.append((start, end, None if out is None else out.clone()))
        return out
    dr.propose = propose
    return seen


def same_greedy_proposals(t, ref_dr, make_dr, tree, n: int, atol: float, prompt=PROMPT):
    """Greedy generations of ``n`` tokens after ``prompt`` with the eager drafter ``ref_dr`` on the model's own
    forward, then, with the target's forward compiled, with the drafter ``make_dr()`` gives: the same tokens,
    acceptances and proposals (every proposal's logits within ``atol``). Returns (that drafter, its result, its
    proposals as (start, end, logits))."""
    ref_seen = recording(ref_dr)
    ref = SpeculativeDecoder(t, ref_dr, policy=FixedLength(3), tree=tree).generate(prompt, n)
    use_fast_forward(t, "compile", autotune=False)
    dr = make_dr()
    seen = recording(dr)
    got = SpeculativeDecoder(t, dr, policy=FixedLength(3), tree=tree).generate(prompt, n)
    assert dr._fast is not None and got.tokens == ref.tokens
    assert [s.accepted for s in got.steps] == [s.accepted for s in ref.steps]
    assert [(a, b) for a, b, _ in seen] == [(a, b) for a, b, _ in ref_seen]
    for (_, _, x), (_, _, y) in zip(seen, ref_seen):
        assert torch.allclose(x, y, atol=atol), (x - y).abs().max()
    return dr, got, seen


def _drafting(m, compile: bool, int8: bool = False, node_slots: int = 64):
    """Make ``m``'s decoder drafters draft through FastEagle3 with these settings."""
    m.fast_drafting = lambda: FastEagle3(m, compile=compile, int8=int8, node_slots=node_slots)
    return m


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
@pytest.mark.parametrize("tree", TREES, ids=IDS)
def test_fast_drafting_proposes_what_the_eager_drafter_does(compiled, tree):
    # float64, the drafter's own weights: the same logits for every proposal of a greedy generation (the model
    # forward and the eager drafter as reference), and so the same drafts and acceptances. Within 1e-5: the eager
    # drafter takes its attention's softmax in float32 (as training does), the compiled one in the model's dtype
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = module(t, std=0.3, vocab_keep=24)
    m.set_draft_vocab(torch.arange(2, 26))
    # node_slots 2: the buffer must grow
    dr, _, _ = same_greedy_proposals(t, m.decoder_drafter(t), lambda: _drafting(
        m, compiled, node_slots=2 if compiled else 64).decoder_drafter(t), tree, 30, 1e-5)
    assert (dr.compile_s > 0) == compiled


def test_a_copied_decode_state_gets_its_own_key_buffer():
    t = tiny(vocab=20, layers=4)
    use_fast_forward(t, "compile", autotune=False)
    dr = _drafting(module(t), compile=False).decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr, tree=[(0,), (1,), (0, 0)])
    st = dec.start(PROMPT, 8)
    c = copy.copy(st.drafter_state)
    assert c.kv is not st.drafter_state.kv and c.kv.keys.data_ptr() != st.drafter_state.kv.keys.data_ptr()
    assert torch.equal(c.kv.keys, st.drafter_state.kv.keys)


@pytest.mark.parametrize("tree", TREES, ids=IDS)
def test_compiled_eagle3_is_exact(tree):
    # Exact enumeration through the compiled target forward and compiled drafting (the compiled forward's bound
    # of tests/test_decoder_enumeration.py: 1e-6)
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=4, dtype=torch.float64)
    use_fast_forward(tgt, "compile", autotune=False)
    ref = target_distribution(tgt, ENUM_PROMPT, N_NEW, TEMP.temperature, TEMP.top_k, TEMP.top_p)
    m = module(tgt, vocab_keep=4)
    m.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    dr = m.decoder_drafter(tgt)
    got = exact_distribution(SpeculativeDecoder(tgt, dr, policy=FixedLength(2), tree=tree, sampling=TEMP),
                             ENUM_PROMPT, N_NEW)
    assert dr._fast is not None and dr.compile_s > 0
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, ref) < 1e-6


def test_int8_drafting_stays_close_and_is_lossless(monkeypatch):
    # int8 (made the default in float32 here; by default it is bf16/fp16's): the logits near the drafter's own,
    # the same top candidate on most proposals; exact enumeration within float32 rounding; greedy output equal to
    # plain decoding
    import draftsmith.common.int8 as int8

    monkeypatch.setattr(int8, "INT8_DTYPES", (torch.float32,))
    t = tiny(vocab=40, layers=4)
    m = module(t, std=0.3, vocab_keep=24)
    m.set_draft_vocab(torch.arange(2, 26))
    use_fast_forward(t, "compile", autotune=False)
    ref_dr = _drafting(m, compile=False, int8=False).decoder_drafter(t)
    ref_seen = recording(ref_dr)
    SpeculativeDecoder(t, ref_dr, tree=STATIC).generate(PROMPT, 24)
    m = module(t, std=0.3, vocab_keep=24)
    m.set_draft_vocab(torch.arange(2, 26))
    dr = m.decoder_drafter(t)
    seen = recording(dr)
    res = SpeculativeDecoder(t, dr, tree=STATIC).generate(PROMPT, 24)
    assert dr._fast.int8
    kept = m.draft_head.kept_ids
    n = min(len(seen), len(ref_seen))
    x = torch.cat([s[2] for s in seen[:1]])[:, kept]
    y = torch.cat([s[2] for s in ref_seen[:1]])[:, kept]  # the first proposal: the same prefix for both
    assert (x - y).abs().max() < 0.1 * y.std()
    agree = sum(int((a[2].argmax(-1) == b[2].argmax(-1)).all()) for a, b in zip(seen[:n], ref_seen[:n]))
    assert agree >= 0.5 * n
    assert res.tokens == SpeculativeDecoder(t).generate(PROMPT, 24).tokens

    tgt = tiny(vocab=6, seed=0, std=0.5, layers=4, dtype=torch.float32)
    use_fast_forward(tgt, "compile", autotune=False)
    ref = target_distribution(tgt, ENUM_PROMPT, N_NEW, TEMP.temperature, TEMP.top_k, TEMP.top_p)
    dr = module(tgt).decoder_drafter(tgt)
    got = exact_distribution(SpeculativeDecoder(tgt, dr, tree=[(0,), (1,), (0, 0)], sampling=TEMP),
                             ENUM_PROMPT, N_NEW)
    assert dr._fast.int8
    assert total_variation(got, ref) < 1e-5


def bf16_drafting_is_lossless(monkeypatch, module, prompt, pruned_module):
    """On a CPU with native bf16 (made so here, whatever this one is) a float32 drafter drafts through a bf16 copy
    (int8, as bf16 drafting does), float32 logits out with the float32 minimum at pruned ids; exact enumeration at
    T=0.8 on a float32 target and greedy equality with plain decoding hold through it. ``pruned_module(tgt)``: the
    kind's drafter over 4 of a 6-id vocabulary; ``module(t, std=...)``: one over the whole vocabulary."""
    import draftsmith.common.int8 as int8

    monkeypatch.delenv("DRAFTSMITH_DRAFT_BF16")
    monkeypatch.setattr(int8, "native_bf16", lambda: True)
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=4, dtype=torch.float32)
    use_fast_forward(tgt, "compile", autotune=False)
    ref = target_distribution(tgt, ENUM_PROMPT, N_NEW, TEMP.temperature, TEMP.top_k, TEMP.top_p)
    m = pruned_module(tgt)
    m.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    dr = m.decoder_drafter(tgt)
    seen = recording(dr)
    got = exact_distribution(SpeculativeDecoder(tgt, dr, policy=FixedLength(2), tree=STATIC, sampling=TEMP),
                             ENUM_PROMPT, N_NEW)
    assert dr._fast.dtype == torch.bfloat16 and dr._fast.int8 and m.fc.weight.dtype == torch.float32
    assert total_variation(got, ref) < 1e-5
    pruned = torch.tensor([1, 4])
    assert all(x.dtype == torch.float32 and (x[:, pruned] == torch.finfo(torch.float32).min).all()
               for _, _, x in seen if x is not None)
    t = tiny(vocab=40, layers=4)
    use_fast_forward(t, "compile", autotune=False)
    dr = module(t, std=0.3).decoder_drafter(t)
    res = SpeculativeDecoder(t, dr, tree=STATIC).generate(prompt, 24)
    assert dr._fast.dtype == torch.bfloat16 and res.tokens == SpeculativeDecoder(t).generate(prompt, 24).tokens


def test_a_float32_eagle3_drafts_in_bf16_where_the_cpu_has_it_and_stays_lossless(monkeypatch):
    bf16_drafting_is_lossless(monkeypatch, module, PROMPT, lambda tgt: module(tgt, vocab_keep=4))
