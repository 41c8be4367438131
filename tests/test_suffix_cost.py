"""Cost-aware SuffixDecoding: drafts cut to the prefix with the most expected tokens per unit of step time, from
verification costs measured on the target and scores calibrated by what was accepted; still lossless."""

from __future__ import annotations

import argparse

import pytest

from draftsmith.cli.shared import add_suffix_args, suffix_config
from draftsmith.drafters.suffix import Draft, SuffixConfig, SuffixDrafter
from draftsmith.drafters.suffix.drafter import Calibration, calibrated, conditionals, cost_cut, interpolate_costs
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.eval.suffix import suffix_methods
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, TEMP, TOPKP
from tests.test_decoder_enumeration import _check as _exact
from tests import test_suffix as base
from tests.test_suffix import _suffix

tgt, references = base.tgt, base.references  # the same tiny target and exact references as tests/test_suffix.py


def test_interpolate_costs_is_linear_monotone_and_extrapolates():
    c = interpolate_costs({1: 1.2, 3: 1.6, 4: 1.5}, 6)
    assert c[0] == 1.0 and c[1] == pytest.approx(1.2) and c[2] == pytest.approx(1.4) and c[3] == pytest.approx(1.6)
    assert c[4] == pytest.approx(1.6)  # measured 1.5 after 1.6: never cheaper with more nodes
    assert c[5] >= c[4] and c[6] >= c[5] and len(c) == 7
    with pytest.raises(ValueError, match="at least one draft size"):
        interpolate_costs({}, 4)


def _draft(probs, parents=None):
    return Draft(tokens=list(range(10, 10 + len(probs))), parents=parents or list(range(-1, len(probs) - 1)),
                 probs=list(probs), score=sum(probs))


def test_cost_cut_keeps_the_best_prefix():
    d = _draft([0.9, 0.8, 0.3, 0.1])
    cost = [1.0, 1.1, 1.2, 2.0, 3.0]
    v, cut = cost_cut(d, cost)
    # (1 + 0.9) / 1.1 = 1.73, (1 + 1.7) / 1.2 = 2.25, (1 + 2.0) / 2.0 = 1.5, 2.1 / 3 = 0.7: two nodes
    assert len(cut) == 2 and cut.tokens == [10, 11] and cut.score == pytest.approx(1.7) and v == pytest.approx(2.25)
    assert cut.parents == [-1, 0]
    # free rows keep everything; an expensive first row makes a plain step (the empty draft, value 1)
    assert len(cost_cut(d, [1.0] * 5)[1]) == 4
    v0, none = cost_cut(d, [1.0, 5.0, 5.0, 5.0, 5.0])
    assert len(none) == 0 and none.score == 0 and v0 == 1.0
    # a cost table shorter than the draft bounds it
    assert len(cost_cut(d, [1.0, 1.0, 1.0])[1]) == 2


def test_cut_tree_keeps_parents_first():
    # best-first order of a tree: two siblings under the root, then a child of the second
    d = _draft([0.6, 0.4, 0.35], parents=[-1, -1, 1])
    _, cut = cost_cut(d, [1.0, 1.0, 1.0, 1.5])
    assert cut.parents == [-1, -1] and all(p < i for i, p in enumerate(cut.parents))


def test_calibration_learns_per_bin_and_reorders_best_first():
    cal = Calibration(bins=5, prior=4.0)
    assert cal(0.9) == pytest.approx(0.9) and cal(0.3) == pytest.approx(0.3)  # no step yet: the counts' word
    for _ in range(96):
        cal.record(1.0, False)  # nodes the counts gave 1.0 (one occurrence), rejected 3 times in 4
        cal.record(0.95, False)
        cal.record(1.0, True)
        cal.record(1.0, False)
    assert cal(1.0) == pytest.approx((96 + 4 * 0.9) / (96 * 3.95 + 4 * 0.9))
    assert cal(0.3) == pytest.approx(0.3)  # another bin: untouched
    assert cal.report()["tested"][4] == 384
    # a chain promised at 1.0 each (one occurrence) against a sibling at 0.5 from many: after calibration the
    # sibling comes first, and parents still come before their children
    d = _draft([1.0, 1.0, 0.5], parents=[-1, 0, -1])
    assert conditionals(d) == [1.0, 1.0, 0.5]
    c = calibrated(d, cal)
    assert c.tokens == [12, 10, 11] and c.parents == [-1, -1, 1]
    assert c.counts_probs == [0.5, 1.0, 1.0] and c.score == pytest.approx(sum(c.probs))
    assert c.probs[2] == pytest.approx(cal(1.0) ** 2)


def test_costs_decide_what_is_drafted(tgt):
    ctx = [0, 4, 3]  # (4, 3) is continued in the global index
    cheap, dear = _suffix(), _suffix()
    cheap.step_cost, dear.step_cost = [1.0] * 25, [1.0] + [50.0] * 24
    drafted = []
    for sd in (cheap, dear):
        dec = SpeculativeDecoder(tgt, sd, sampling=TEMP)
        drafted.append(dec.draft(dec.start(ctx, N_NEW), TorchRandom(0)).n)
    assert drafted[0] > 0 and drafted[1] == 0


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_cost_aware_suffix_is_exact(tgt, references, sampling):
    sd = _suffix()
    sd.step_cost = [1.0, 1.05, 1.3, 1.6, 2.0] + [3.0] * 20  # injected: some drafts cut, some kept
    for _ in range(8):  # a calibration that rejects many count-certain nodes, moved on by each commit
        sd.calibration.record(1.0, False)
    _exact(tgt, references, sd, sampling)


def test_calibration_follows_what_was_accepted(tgt):
    sd = _suffix()
    sd.step_cost = [1.0] * 25
    dec = SpeculativeDecoder(tgt, sd, sampling=SamplingParams(0.0))
    for s in range(4):
        dec.generate([0, 4, 3], 12, seed=s)
    tested = sum(sd.calibration.tried)
    assert tested > 0 and sum(sd.calibration.hits) < sum(sd.calibration.expected)  # counts promise more than a
    # random target gives
    assert sd.stats()["cost_aware"]["calibration"]["tested"] == sd.calibration.tried


def test_calibrate_measures_and_greedy_equals_plain():
    t = tiny(vocab=40, seed=1, std=0.3)
    sd = SuffixDrafter(SuffixConfig(cost_aware=True, max_spec_tokens=6))
    dec, plain = SpeculativeDecoder(t, sd), SpeculativeDecoder(t)
    prompts = [[1, 5, 9, 5, 9], [2, 5, 9, 5, 9, 3], [1, 5, 9, 5, 9]]
    for p in prompts:
        assert dec.generate(p, 20).tokens == plain.generate(p, 20).tokens
    c = sd.step_cost
    assert c is not None and len(c) == 7 and c[0] == 1.0 and all(b >= a for a, b in zip(c, c[1:]))
    assert "cost_aware" in sd.stats()


def test_cli_cost_aware_options():
    ap = argparse.ArgumentParser()
    add_suffix_args(ap, "help")
    assert suffix_config(ap.parse_args(["--suffix-cost-aware", "on"])).cost_aware
    assert not suffix_config(ap.parse_args([])).cost_aware
    both = ap.parse_args(["--suffix-cost-aware", "both"])
    with pytest.raises(ValueError, match="side by side"):
        suffix_config(both)
    assert not suffix_config(both, both_ok=True).cost_aware  # the first of the two is the configured one


def test_suffix_methods_side_by_side(tgt):
    cfg = SuffixConfig()
    methods, members = suffix_methods(tgt, SamplingParams(0.0), [], config=cfg, hf_lookup=False, ours_lookup=False,
                                      also=[("cost-aware", cfg.model_copy(update={"cost_aware": True}))])
    assert [m.name for m in methods] == ["ours suffix", "ours suffix (cost-aware)"]
    assert not members["ours suffix"].config.cost_aware and members["ours suffix (cost-aware)"].config.cost_aware
