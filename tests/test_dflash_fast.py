"""Compiled DFlash drafting (drafters/dflash/fast.py): the eager drafter's numbers, its own buffers per decode state,
and the decoder's losslessness through it (exact enumeration: chain, static and dynamic trees; greedy equality with
plain decoding), with the drafter's weights and with int8 ones."""

import copy

import pytest
import torch

from draftsmith.drafters.dflash.fast import FastDFlash
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.trees import DynamicTree, StaticTree
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP
from tests.test_dflash import PROMPT, module
from tests.test_eagle3_fast import bf16_drafting_is_lossless, recording, same_greedy_proposals

STATIC = StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
TREES = [None, STATIC, DynamicTree(budget=6, max_depth=3, width=2, expand_batch=2)]
IDS = ["chain", "static", "dynamic"]


@pytest.fixture(autouse=True)
def _drafting_in_the_modules_dtype(monkeypatch):
    """These tests compare compiled drafting's numbers with the eager drafter's: drafting in the module's own dtype
    on every CPU (on one with native bf16 a float32 module would otherwise draft in bf16: `drafting_dtype`, tested
    below with the variable unset)."""
    monkeypatch.setenv("DRAFTSMITH_DRAFT_BF16", "0")


def _drafting(m, compile: bool, int8: bool = False):
    """Make ``m``'s decoder drafters draft through FastDFlash with these settings."""
    m.fast_drafting = lambda: FastDFlash(m, compile=compile, int8=int8)
    return m


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
@pytest.mark.parametrize("tree", TREES, ids=IDS)
def test_fast_drafting_proposes_what_the_eager_drafter_does(compiled, tree):
    # float64, the drafter's own weights, a pruned head: the same logits for every proposal of a greedy generation
    # (the model forward and the module's eager drafting as reference), so the same drafts and acceptances. Within
    # 1e-5: the target states the drafter reads come from the compiled target forward here, from the model's own
    # in the reference (they differ by about 1e-6; the next test compares the drafting alone, on the same states)
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = module(t, std=0.3, vocab_keep=24)
    m.set_draft_vocab(torch.arange(2, 26))
    dr, _, seen = same_greedy_proposals(t, m.decoder_drafter(t), lambda: _drafting(m, compiled).decoder_drafter(t),
                                        tree, 30, 1e-5, prompt=PROMPT)
    assert (dr.compile_s > 0) == compiled
    assert all((x[:, m.config.mask_token_id] == torch.finfo(x.dtype).min).all() for _, _, x in seen)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
def test_feeding_several_positions_a_step_equals_the_modules_block(compiled):
    # what a step after acceptances does: feed 3 new positions (padded to a bucket of 4 when compiled) into a context
    # that holds 4, then draft; against the module's own context and block over all 7 positions
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = module(t, std=0.3, vocab_keep=24)
    m.set_draft_vocab(torch.arange(2, 26))
    use_fast_forward(t, "compile", autotune=False)
    fast = FastDFlash(m, compile=compiled)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(7, m.fc.in_features, generator=g, dtype=torch.float64)
    kv = fast.new_kv(16)
    fast.draft(kv, feats[:4], 0, 5)
    got = fast.draft(kv, feats[4:], 4, 9)
    S = m.block_size
    ids = torch.full((S,), m.config.mask_token_id)
    ids[0] = 9
    with torch.no_grad():
        ctx = m.context_kv(m.fuse(feats), torch.arange(7))
        want = m.draft_head.to_target(m.project(m.block(ids, torch.arange(7, 7 + S), ctx, None)[1:]))
    keep = torch.arange(t.vocab_size) != m.config.mask_token_id
    assert torch.allclose(got[:, keep], want[:, keep], atol=1e-9)
    assert (fast.compile_s > 0) == compiled


def test_a_copied_decode_state_gets_its_own_buffers():
    t = tiny(vocab=20, layers=4)
    use_fast_forward(t, "compile", autotune=False)
    dr = _drafting(module(t), compile=False).decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr, tree=[(0,), (1,), (0, 0)])
    st = dec.start(PROMPT, 8)
    c = copy.copy(st.drafter_state)
    for a, b in zip(c.kv, st.drafter_state.kv):
        assert a is not b and a.keys.data_ptr() != b.keys.data_ptr() and torch.equal(a.keys, b.keys)


@pytest.mark.parametrize("tree", TREES, ids=IDS)
def test_compiled_dflash_is_exact(tree):
    # Exact enumeration through the compiled target forward and compiled drafting (the compiled forward's bound
    # of tests/test_decoder_enumeration.py: 1e-6)
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=4, dtype=torch.float64)
    use_fast_forward(tgt, "compile", autotune=False)
    ref = target_distribution(tgt, ENUM_PROMPT, N_NEW, TEMP.temperature, TEMP.top_k, TEMP.top_p)
    m = module(tgt, vocab_keep=4, block_size=4, mask=1)
    m.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    dr = m.decoder_drafter(tgt)
    got = exact_distribution(SpeculativeDecoder(tgt, dr, policy=FixedLength(2), tree=tree, sampling=TEMP),
                             ENUM_PROMPT, N_NEW)
    assert dr._fast is not None and dr.compile_s > 0
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, ref) < 1e-6


def test_int8_drafting_stays_close_and_is_lossless(monkeypatch):
    # int8 (made the default in float32 here; by default it is bf16/fp16's): the first proposal's logits near the
    # drafter's own; greedy output equal to plain decoding
    import draftsmith.common.int8 as int8

    monkeypatch.setattr(int8, "INT8_DTYPES", (torch.float32,))
    t = tiny(vocab=40, layers=4)
    use_fast_forward(t, "compile", autotune=False)
    m = module(t, std=0.3)
    ref_dr = _drafting(m, compile=False, int8=False).decoder_drafter(t)
    ref_seen = recording(ref_dr)
    SpeculativeDecoder(t, ref_dr, tree=STATIC).generate(PROMPT, 24)
    m = module(t, std=0.3)
    dr = m.decoder_drafter(t)
    seen = recording(dr)
    res = SpeculativeDecoder(t, dr, tree=STATIC).generate(PROMPT, 24)
    assert dr._fast.int8
    keep = torch.arange(t.vocab_size) != m.config.mask_token_id
    x, y = seen[0][2][:, keep], ref_seen[0][2][:, keep]  # the first proposal: the same prefix for both
    assert (x - y).abs().max() < 0.1 * y.std()
    assert res.tokens == SpeculativeDecoder(t).generate(PROMPT, 24).tokens


def test_a_float32_dflash_drafts_in_bf16_where_the_cpu_has_it_and_stays_lossless(monkeypatch):
    bf16_drafting_is_lossless(monkeypatch, module, PROMPT,
                              lambda tgt: module(tgt, vocab_keep=4, block_size=4, mask=1))
