"""Sampling distributions and the verification rules, with injected uniforms and hand-computed outcomes."""

import pytest
import torch

from draftsmith.eval.exact import BranchingSource, enumerate_branches
from draftsmith.engine.sampling import (SamplingParams, TorchRandom, UniformSource, WithoutReplacement, inverse_cdf,
                                      inverse_cdf_rows, processed_probs, verify_chain, verify_node, verify_node_greedy,
                                      verify_node_typical)

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q = torch.tensor([0.4, 0.3, 0.2, 0.1])


def test_processed_probs_temperature_topk_topp():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.5, -1.0])
    assert torch.allclose(processed_probs(logits, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(processed_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    # top-k = 3: the 3rd value (0.5) is tied, so both 0.5 entries stay.
    pk = processed_probs(logits, 1.0, top_k=3)
    assert (pk > 0).tolist() == [True, True, True, True, False]
    assert torch.allclose(pk[:4], torch.softmax(logits[:4], -1))
    # top-p: softmax([2, 1, .5, .3, -1]) = [.548, .202, .122, .100, .027]; the mass before
    # token 2 is .750 < .8 (kept), before token 3 it is .873 (dropped).
    lp = torch.tensor([2.0, 1.0, 0.5, 0.3, -1.0])
    pp = processed_probs(lp, 1.0, top_p=0.8)
    assert (pp > 0).tolist() == [True, True, True, False, False]
    assert torch.allclose(pp[:3], torch.softmax(lp[:3], -1))
    assert (processed_probs(lp, 1.0, top_p=0.5) > 0).tolist() == [True, False, False, False, False]
    # top-k then top-p compose: top-2 renormalised = [.731, .269] -> top_p .7 keeps one.
    assert (processed_probs(lp, 1.0, top_k=2, top_p=0.7) > 0).tolist() == [True, False, False, False, False]
    # greedy is the one-hot argmax; bf16 logits come out as fp32.
    assert processed_probs(logits, 0.0).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert processed_probs(logits.bfloat16(), 0.7, 2, 0.9).dtype == torch.float32
    assert abs(float(processed_probs(torch.randn(7, 50), 0.8, 10, 0.9).sum(-1).sub(1).abs().max())) < 1e-6


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-2)
    assert SamplingParams().greedy and not SamplingParams(0.7).greedy


def test_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert inverse_cdf(probs, 0.0) == 1
    assert inverse_cdf(probs, 0.2499) == 1
    assert inverse_cdf(probs, 0.25) == 3
    assert inverse_cdf(probs, 0.999999) == 3
    assert inverse_cdf(probs * 4, 0.5) == 3  # unnormalised input


def test_chain_accept_then_bonus():
    # Draft [0, 1]: ratios p/q = 0.25 and 0.2/0.3; uniforms 0.2 and 0.6 accept both; bonus from p[2] at u=0.35.
    p = torch.stack([P, P, torch.tensor([0.3, 0.3, 0.2, 0.2])])
    q = torch.stack([Q, Q])
    rng = UniformSource([0.2, 0.6, 0.35])
    assert verify_chain(p, q, [0, 1], rng) == (2, 1)  # cdf [.3, .6, ...]: 0.35 -> token 1
    assert rng.used == 3


def test_chain_reject_samples_residual():
    # Draft 0 with ratio 0.25; u = 0.3 rejects. Residual max(0, p - q) = [0, 0, .1, .3] -> [0, 0, .25, .75].
    p, q = torch.stack([P, P]), Q[None]
    assert verify_chain(p, q, [0], UniformSource([0.3, 0.2])) == (0, 2)
    assert verify_chain(p, q, [0], UniformSource([0.3, 0.26])) == (0, 3)
    # u exactly at the ratio accepts (u <= p/q).
    assert verify_chain(p, q, [0], UniformSource([0.25, 0.5])) == (1, 2)  # bonus from P: cdf [.1, .3, .6, 1]


def test_chain_second_rejection_after_first_acceptance():
    # Draft [3, 0]: token 3 has p/q = 4 (always accepted, a uniform is still drawn), token 0 ratio 0.25 rejected.
    p, q = torch.stack([P, P, P]), torch.stack([Q, Q])
    rng = UniformSource([0.99, 0.9, 0.0])
    assert verify_chain(p, q, [3, 0], rng) == (1, 2)  # residual [0, 0, .25, .75] at u = 0 -> token 2


def test_tree_node_without_replacement_hand_computed():
    # p = [.1, .5, .2, .2], q = [.5, .2, .2, .1]; children drawn without replacement: 0 then 2.
    p = torch.tensor([0.1, 0.5, 0.2, 0.2])
    q = torch.tensor([0.5, 0.2, 0.2, 0.1])
    # child 0: ratio .2, u = .5 rejects. p1 = [0, .75, 0, .25]; q1 = q without 0 = [0, .4, .4, .2].
    # child 2: ratio 0/.4 = 0 rejects. p2 = norm(max(0, p1 - q1)) = [0, .875, 0, .125].
    # final draw at u = .85 -> token 1 (cdf .875). With replacement (q kept) p2 would be
    # [0, .786, 0, .214] and u = .85 would give token 3: the test tells the two rules apart.
    v = verify_node(p, [0, 2], q, UniformSource([0.5, 0.5, 0.85]))
    assert v.child is None and v.token == 1
    v = verify_node(p, [0, 2], q, UniformSource([0.5, 0.5, 0.9]))
    assert v.token == 3
    # second child accepted: child 1 after rejecting 0 has ratio .75 / .4 >= 1.
    v = verify_node(p, [0, 1], q, UniformSource([0.5, 0.999]))
    assert v.child == 1 and v.token is None


def test_tree_node_rejects_token_outside_q():
    with pytest.raises(ValueError, match="zero draft probability"):
        verify_node(P, [1], torch.tensor([0.5, 0.0, 0.5, 0.0]), UniformSource([0.1]))


def test_tree_node_exact_distribution_is_p():
    # Enumerate every child draw (without replacement, 3 children) and every acceptance branch.
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
    q = torch.tensor([0.3, 0.1, 0.35, 0.05, 0.2], dtype=torch.float64)

    def run(rng):
        draw = WithoutReplacement(q, rng)
        kids = [draw.next() for _ in range(3)]
        v = verify_node(p, kids, q, rng)
        return kids[v.child] if v.child is not None else v.token

    out = torch.zeros(5, dtype=torch.float64)
    for tok, w, _ in enumerate_branches(run):
        out[tok] += w
    assert float((out - p).abs().max()) < 1e-12


def test_without_replacement_exhausts_support():
    draw = WithoutReplacement(torch.tensor([0.0, 0.7, 0.3]), UniformSource([0.5, 0.1]))  # cdf [0, .7, 1]: u = .5 -> 1
    assert [draw.next(), draw.next(), draw.next()] == [1, 2, None]


def test_greedy_and_typical_rules():
    assert verify_node_greedy(3, [1, 3]).child == 1
    v = verify_node_greedy(2, [1, 3])
    assert v.child is None and v.token == 2
    # typical: p nearly uniform over 4 tokens -> H = ln 4, threshold = min(.09, .3/4) = .075.
    p = torch.tensor([0.26, 0.26, 0.26, 0.22])
    assert verify_node_typical(p, [3], UniformSource([])).child == 0


def test_branching_source_weights_sum_to_one():
    def run(rng):
        a = rng.categorical(torch.tensor([0.2, 0.0, 0.8]))
        return (a, rng.accept(0.3))

    leaves = enumerate_branches(run)
    assert len(leaves) == 4
    assert abs(sum(w for _, w, _ in leaves) - 1.0) < 1e-15
    assert dict(((r, w) for r, w, _ in leaves))[(2, True)] == pytest.approx(0.24)
    src = BranchingSource([1])
    assert src.categorical(torch.tensor([0.5, 0.5])) == 1


def test_torch_random_is_seeded():
    a = [TorchRandom(3).categorical(torch.ones(10)) for _ in range(2)]
    assert a[0] == a[1]
    r = TorchRandom(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[r.categorical(torch.tensor([0.2, 0.3, 0.5]))] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.2, 0.3, 0.5]), atol=0.04)


def test_greedy_ids_breaks_ties_as_argmax():
    """The decoder's greedy pick (max's indices, faster on CPU) equals argmax, ties included, in every dtype."""
    from draftsmith.engine.sampling import greedy_ids

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for rows, vocab in ((1, 7), (3, 100), (8, 49152)):
            x = (torch.randn(rows, vocab, generator=g) * 2).round().to(dtype)  # many equal maxima per row
            top = x.max(-1).values
            x[:, vocab // 2], x[:, -1] = top, top  # at least two maxima in every row
            assert torch.equal(greedy_ids(x), x.argmax(-1))
            assert torch.equal(greedy_ids(x[0]), x[0].argmax())
            assert (greedy_ids(x) <= vocab // 2).all()  # the first of the tied maxima, never the last


def test_inverse_cdf_rows_never_takes_a_zero_probability_token_past_a_rounded_block_mass():
    """A block's float32 mass can exceed its float64 total; a uniform landing in that gap once took the block's
    last slot even at probability 0. It takes the last token of positive probability instead."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(10_000):  # a block of 4 whose float32 sum rounds above its float64 sum, last slot empty
        p = torch.rand(4, generator=gen, dtype=torch.float32)
        p[3] = 0.0
        f32, f64 = float(p.sum()), float(p.double().sum())
        if f32 > f64:
            break
    else:
        raise AssertionError("no block with a float32 mass above its float64 total")
    u = ((f32 + f64) / 2) / f32  # target = u * f32 lies between the float64 total and the float32 mass
    assert int(inverse_cdf_rows(p[None], torch.tensor([u], dtype=torch.float64), block=4)[0]) == 2
    assert inverse_cdf(p, u) == 2
