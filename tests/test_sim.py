"""The simulator (draftsmith.sim): pricing by hand, the DSI model against its theory, traces from real
decodes on a tiny model, calibration's fit, and clear errors for bad input. No timings are asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.sim import dsi
from draftsmith.sim.calibrate import Calibrator, fit_step_costs, run_terms
from draftsmith.sim.profile import DrafterCost, ForwardTable, Overhead, Profile, ProfileError, load_profile
from draftsmith.sim.steps import (Run, Step, StepTrace, StepTraceError, check_trace_for, from_batch_results,
                                  from_results, load_step_trace, simulate_trace, step_seconds, target_identity)
from tests.tiny import make_tiny_target

TID = {"name": "t", "fingerprint": "abc", "vocab_size": 96, "tokenizer": "tok"}


def linear_profile(**over) -> Profile:
    """forward(r, c) = 0.010 + 0.001 r + 0.0001 c seconds (exactly linear, so interpolation is exact)."""
    rows, ctxs = [1, 2, 4, 8, 16, 64], [0, 100]
    sec = [[0.010 + 0.001 * r + 0.0001 * c for r in rows] for c in ctxs]
    kw = dict(name="lin", hardware="test", source="hand-made", target=dict(TID),
              forward=ForwardTable(rows=rows, contexts=ctxs, seconds=sec),
              overhead=Overhead(step_s=0.002, sequence_s=0.003, batch_step_s=0.004),
              drafters={"d": DrafterCost(pass_s=0.005, step_s=0.001, node_s=0.0005)})
    kw.update(over)
    return Profile(**kw)


# ---------------------------------------------------------------------------- pricing by hand
def test_plain_decoding_time_is_the_sum_of_its_step_costs():
    p = linear_profile()
    steps = [Step(rows=5, context=0, nodes=0, passes=0, accepted=0, emitted=1)] + [
        Step(rows=1, context=5 + i, nodes=0, passes=0, accepted=0, emitted=1) for i in range(9)]
    tr = StepTrace("plain", TID, None, [Run(steps, [], 10, wall_s=1.0)])
    want = sum(0.010 + 0.001 * s.rows + 0.0001 * s.context + 0.002 for s in steps)
    r = simulate_trace(tr, p)
    assert r["simulated_s"] == pytest.approx(want)
    assert r["simulated_tokens_per_s"] == pytest.approx(10 / want)
    assert r["error"] == pytest.approx((10 / want) / 10.0 - 1)


def test_fixed_k_chain_matches_a_hand_computed_time():
    p = linear_profile()
    # prefill of 7 rows (no logits), then two K=4 steps: accepted 2 then 4
    steps = [Step(rows=5, context=7, nodes=4, passes=4, accepted=2, emitted=3),
             Step(rows=5, context=10, nodes=4, passes=4, accepted=4, emitted=5)]
    tr = StepTrace("chain", TID, "d", [Run(steps, [7], 8)])
    prefill = 0.010 + 0.007  # body only: the profile has no separate head table, so all rows count
    step = lambda c: 0.010 + 0.005 + 0.0001 * c + 0.002 + (0.001 + 4 * 0.005 + 4 * 0.0005)  # noqa: E731
    assert simulate_trace(tr, p)["simulated_s"] == pytest.approx(prefill + step(7) + step(10))


def test_head_table_prices_only_projected_rows():
    rows = [1, 2, 8]
    f = ForwardTable(rows=rows, contexts=[0], seconds=[[1.0, 2.0, 8.0]], head_seconds=[0.5, 1.0, 4.0])
    p = linear_profile(forward=f)
    assert p.forward_s(8, 0, 0) == pytest.approx(8.0)
    assert p.forward_s(8, 0, 2) == pytest.approx(9.0)
    assert p.forward_s(5, 0) == pytest.approx(5.0 + 2.5)


def test_batched_step_adds_its_sequences():
    p = linear_profile()
    s = Step(rows=12, context=50, nodes=8, passes=2, accepted=3, emitted=7, live=4)
    want = 0.010 + 0.012 + 0.005 + 0.002 + 0.004 + 3 * 0.003 + (0.001 + 2 * 0.005 + 8 * 0.0005)
    assert step_seconds(s, p, "d", batched=True) == pytest.approx(want)


def test_relative_cost_is_in_units_of_a_one_row_step():
    p = linear_profile()
    c = p.relative_cost("d", 4, context=0)
    assert c["verify"][0] == 1.0
    one = 0.011 + 0.002
    assert c["verify"][4] == pytest.approx((0.015 + 0.002) / one)
    assert c["draft_per_forward"] == pytest.approx(0.005 / one)


# ---------------------------------------------------------------------------- DSI model
def test_si_matches_its_closed_form():
    for c, a, k in [(0.1, 0.8, 4), (0.3, 0.5, 2), (0.05, 0.9, 6)]:
        mc = dsi.costs(c, a, k, S=20000, repeats=2)
        assert 20000 / mc["si"] == pytest.approx(dsi.si_expected_speedup(c, a, k), rel=0.02)


def test_si_is_slower_than_plain_with_a_slow_or_inaccurate_drafter():
    assert dsi.speedups(0.5, 0.2, range(1, 6))["si_over_plain"] < 1
    assert dsi.speedups(0.9, 0.6, range(1, 6))["si_over_plain"] < 1


def test_dsi_never_slower_than_si_or_plain_with_enough_instances():
    cs, accs = np.array([0.02, 0.1, 0.3, 0.6, 1.0]), np.array([0.01, 0.3, 0.6, 0.9])
    for cell in dsi.grid(cs, accs, ks=range(1, 9), servers=100, S=2000, repeats=3):
        assert cell["dsi_over_plain"] >= 1.0 - 1e-9
        assert cell["dsi_over_si"] >= 0.99  # Monte Carlo: SI and DSI consume the shared draws differently


def test_dsi_with_nothing_accepted_is_plain_decoding():
    acc = np.zeros(100, dtype=np.int64)
    assert dsi.dsi_cost(acc, 4, 0.3, 50) == pytest.approx(50.0)
    assert dsi.si_cost(acc, 4, 0.3, 50) > 50.0


def test_dsi_refuses_lookaheads_its_instances_cannot_serve():
    assert dsi.min_servers(2, 0.1) == 5
    with pytest.raises(ValueError, match="target instances"):
        dsi.speedups(0.01, 0.5, range(1, 3), servers=7)


# ---------------------------------------------------------------------------- traces of real decodes
@pytest.fixture(scope="module")
def tiny():
    t = make_tiny_target()
    return t, first_layers_drafter(t, 1)


def test_traces_from_real_decodes_count_rows_contexts_and_tokens(tiny):
    t, d = tiny
    prompt = [3, 5, 7, 9, 11]
    plain = SpeculativeDecoder(t).generate(prompt, 12, seed=0)
    tr = from_results([plain], mode="plain", target_id=target_identity(t), drafter=None)
    steps = tr.runs[0].steps
    assert tr.runs[0].prefill_rows == [] and steps[0].rows == len(prompt) and steps[0].context == 0
    assert all(s.rows == 1 for s in steps[1:]) and [s.context for s in steps[1:3]] == [5, 6]
    assert tr.tokens == len(plain.tokens) == sum(s.emitted for s in steps)
    chain = SpeculativeDecoder(t, d, policy=FixedLength(3)).generate(prompt, 12, seed=0)
    tc = from_results([chain], mode="chain", target_id=target_identity(t), drafter="d", max_len=3)
    assert all(s.rows == s.nodes + 1 or s.context == 0 for s in tc.runs[0].steps)
    assert all(s.passes == s.nodes for s in tc.runs[0].steps)
    conf = SpeculativeDecoder(t, d, policy=ConfidenceStop(0.99, 3)).generate(prompt, 12, seed=0)
    tf = from_results([conf], mode="chain", target_id=target_identity(t), drafter="d", probes_next=True, max_len=3)
    assert all(s.passes == s.nodes + (s.nodes < 3) for s in tf.runs[0].steps if s.nodes)
    b = BatchedSpeculativeDecoder(t, d, k=2).generate([prompt, [4, 6, 8]], 10, seed=0)
    tb = from_batch_results([b], target_id=target_identity(t), drafter="d")
    assert tb.tokens == b.tokens and [s.live for s in tb.runs[0].steps] == [s.live for s in b.steps]
    assert all(s.rows == s.nodes + s.live for s in tb.runs[0].steps)


def test_calibration_fits_and_prices_a_tiny_model(tiny, tmp_path):
    t, d = tiny
    cal = Calibrator(t, name="tiny-here", hardware="test", drafter=d, drafter_name="first1", ks=(1, 3),
                     batch_sizes=(2,), max_new_tokens=6, rows=[1, 2, 4, 8, 16], contexts=[0, 16])
    prompts = [[3, 5, 7], [4, 6, 8, 10], [9, 2]]
    for i in range(2):
        cal.round(prompts, i)
    prof, report = cal.fit()
    assert report["runs"] == 2 * (1 + 2 + 1) and "first1" in prof.drafters
    path = prof.save(tmp_path / "p.yaml")
    again = load_profile(path)
    assert again.forward_s(3, 5) == pytest.approx(prof.forward_s(3, 5))
    r = SpeculativeDecoder(t, d, policy=FixedLength(3)).generate(prompts[0], 6)
    tr = from_results([r], mode="chain", target_id=target_identity(t), drafter="first1")
    assert simulate_trace(tr, again)["simulated_s"] > 0


def test_fit_recovers_known_costs():
    p = linear_profile()
    truth = {"step": 0.002, "dstep": 0.001, "pass": 0.005, "node": 0.0005}
    runs = []
    rng = np.random.default_rng(0)
    for _ in range(12):
        n = int(rng.integers(1, 6))
        steps = [Step(rows=n + 1, context=int(rng.integers(0, 90)), nodes=n, passes=n + int(rng.integers(0, 2)),
                      accepted=0, emitted=1) for _ in range(5)]
        steps += [Step(rows=1, context=20, nodes=0, passes=0, accepted=0, emitted=1)] * int(rng.integers(0, 4))
        run = Run(steps, [], len(steps))
        secs = sum(step_seconds(s, p, "d") for s in steps)
        runs.append((run, secs, False))
    o, dc, _ = fit_step_costs(p, runs)
    assert o.step_s == pytest.approx(truth["step"], abs=1e-6)
    assert dc.pass_s == pytest.approx(truth["pass"], rel=1e-3) and dc.node_s == pytest.approx(truth["node"], abs=1e-5)
    assert list(run_terms(runs[0][0], False))[1] == 5


# ---------------------------------------------------------------------------- bad input
def test_trace_from_another_target_or_tokenizer_is_refused():
    tr = StepTrace("plain", TID, None, [])
    with pytest.raises(StepTraceError, match="fingerprint"):
        check_trace_for(tr, {**TID, "fingerprint": "zzz"})
    with pytest.raises(StepTraceError, match="vocab_size"):
        check_trace_for(tr, {**TID, "vocab_size": 49152})
    with pytest.raises(StepTraceError, match="tokenizer"):
        check_trace_for(tr, {**TID, "tokenizer": "other"})
    check_trace_for(tr, {"name": "llama"})  # a published profile names its target only: nothing to compare


def test_profile_with_missing_shapes_is_refused():
    p = linear_profile()
    with pytest.raises(ProfileError, match="no forward time for 65 rows"):
        p.forward_s(65, 0)
    with pytest.raises(ProfileError, match="no cost for drafter 'other'"):
        p.draft_s("other", 2, 2)
    tr = StepTrace("chain", TID, "d", [Run([Step(100, 0, 99, 99, 0, 1)], [], 1)])
    with pytest.raises(ProfileError, match="100 rows"):
        simulate_trace(tr, p)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["forward"]["seconds"][0].__setitem__(0, -0.01), "positive"),
    (lambda d: d["forward"]["seconds"][0].__setitem__(0, 0.0), "positive"),
    (lambda d: d["drafters"]["d"].__setitem__("pass_s", 0.0), "pass_s"),
    (lambda d: d["overhead"].__setitem__("step_s", -1.0), "step_s"),
    (lambda d: d["forward"].__setitem__("rows", [1, 2, 4, 8, 16]), "forward.seconds must be"),
    (lambda d: d.pop("forward"), "forward"),
])
def test_bad_profiles_name_the_problem(tmp_path, edit, match):
    d = linear_profile().model_dump()
    edit(d)
    path = tmp_path / "bad.yaml"
    path.write_text(__import__("yaml").safe_dump(d))
    with pytest.raises(ProfileError, match=match):
        load_profile(path)


def test_unknown_profile_and_bad_trace_files(tmp_path):
    with pytest.raises(ProfileError, match="not a built-in profile"):
        load_profile("no-such-profile")
    (tmp_path / "x.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(StepTraceError, match="not a step trace"):
        load_step_trace(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"format": "draftsmith-step-trace/1", "mode": "chain",
                                                 "target": TID, "drafter": "d",
                                                 "runs": [{"steps": [[0, 0, 1, 1, 0, 1, 1]], "prefill_rows": [],
                                                           "tokens": 1}]}))
    with pytest.raises(StepTraceError, match="impossible step"):
        load_step_trace(tmp_path / "y.json")


def test_dsi_rejects_bad_costs():
    for c in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            dsi.costs(c, 0.5, 2)
    with pytest.raises(ValueError, match="acceptance"):
        dsi.costs(0.1, 1.0, 2)


def test_builtin_gpu_profile_loads_and_says_where_it_comes_from():
    p = load_profile("h100-llama31-8b-sglang")
    assert "158.34" in p.source and any("ASSUMPTION" in a for a in p.assumptions)
    assert p.forward_s(9, 100) / p.forward_s(1, 100) < 1.1  # verification rows nearly free there (assumed)


def test_cli_run_and_dsi(tmp_path, capsys):
    from draftsmith.cli import main

    p = linear_profile()
    p.save(tmp_path / "p.yaml")
    steps = [Step(rows=5, context=0, nodes=4, passes=4, accepted=1, emitted=2)] * 3
    StepTrace("chain", TID, "d", [Run(steps, [], 6, wall_s=0.5)]).save(tmp_path / "t.json")
    assert main(["simulate", "run", str(tmp_path / "t.json"), "--profile", str(tmp_path / "p.yaml")]) == 0
    out = capsys.readouterr().out
    assert "simulated:" in out and "measured (wall)" in out
    StepTrace("chain", {**TID, "fingerprint": "other"}, "d", [Run(steps, [], 6)]).save(tmp_path / "u.json")
    assert main(["simulate", "run", str(tmp_path / "u.json"), "--profile", str(tmp_path / "p.yaml")]) != 0
    assert "fingerprint" in capsys.readouterr().err
    assert main(["simulate", "dsi", "--point", "x:0.5:0.2", "--max-lookahead", "4", "--tokens", "200",
                 "--repeats", "1", "--out", str(tmp_path / "d.json")]) == 0
    pt = json.loads((tmp_path / "d.json").read_text())["points"][0]
    assert pt["si_over_plain"] < 1 <= pt["dsi_over_plain"]


def test_batch_aware_policy_under_a_profile():
    from draftsmith.engine.batch_policy import BatchAwareLength
    from draftsmith.sim.batch import acceptance_by_depth, batch_table

    p = linear_profile()
    tab = batch_table(p, "d", [0.9, 0.8, 0.7], batch_sizes=[1, 8], ks=[1, 2, 3], context=50)
    s1 = 0.010 + 0.001 * 2 + 0.005 + 0.002 + 0.004 + (0.001 + 0.005 + 0.0005)
    assert tab.cost(1, 1) == pytest.approx(s1)
    assert tab.cost(8, 0) == pytest.approx(0.010 + 0.008 + 0.005 + 0.002 + 0.004 + 7 * 0.003)
    pol = BatchAwareLength(tab, margin=0.0)
    assert pol.choose(1) >= 1  # cheap rows, good acceptance: speculate
    bad = batch_table(p, "d", [0.01], batch_sizes=[1], ks=[1], context=50)
    assert BatchAwareLength(bad, margin=0.0).choose(1) == 0  # nothing accepted: plain decoding
    pos, ratio = np.array([1, 1, 2, 2, 3]), np.array([1.0, 0.0, 1.0, 1.0, 0.5])
    assert acceptance_by_depth(pos, ratio, 4) == [0.5, 1.0, 0.5, 0.0]


def test_cli_compare_prices_each_drafter_against_plain_under_each_profile(tmp_path, capsys):
    from draftsmith.cli import main

    lin = linear_profile()
    lin.save(tmp_path / "lin.yaml")
    # a second profile whose forward is twice as slow and whose only drafter entry has another name
    slow = linear_profile(name="slow", forward=ForwardTable(rows=[1, 64], contexts=[0, 100],
                                                            seconds=[[0.022, 0.148], [0.042, 0.168]]),
                          drafters={"head": DrafterCost(pass_s=0.001)})
    slow.save(tmp_path / "slow.yaml")
    plain = [Step(rows=1, context=i, nodes=0, passes=0, accepted=0, emitted=1) for i in range(6)]
    chain = [Step(rows=5, context=2 * i, nodes=4, passes=4, accepted=1, emitted=2) for i in range(3)]
    StepTrace("plain", TID, None, [Run(plain, [], 6)]).save(tmp_path / "plain.json")
    StepTrace("chain", TID, "d", [Run(chain, [], 6)]).save(tmp_path / "d.json")
    rc = main(["simulate", "compare", str(tmp_path / "d.json"), "--plain", str(tmp_path / "plain.json"),
               "--profile", str(tmp_path / "lin.yaml"), str(tmp_path / "slow.yaml"), "--out", str(tmp_path / "c.json")])
    assert rc == 0
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    got = rows[0]["profiles"]
    for prof, name in ((lin, "d"), (slow, "head")):
        want = simulate_trace(StepTrace("chain", TID, "d", [Run(chain, [], 6)]), prof, name)["simulated_tokens_per_s"]
        base = simulate_trace(StepTrace("plain", TID, None, [Run(plain, [], 6)]), prof)["simulated_tokens_per_s"]
        assert got[prof.name]["drafter_cost"] == name
        assert got[prof.name]["speedup"] == pytest.approx(want / base)
    assert rows[0]["tau"] == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert "d priced as slow's 'head'" in out and "| d | chain | 2.00 |" in out
    # tau over the tau that breaks even is the speedup
    assert all(v["speedup"] == pytest.approx(2.0 / v["break_even_tau"]) for v in got.values())
    # a plain trace that is not plain, and a profile without the drafter among several entries, are refused
    assert main(["simulate", "compare", str(tmp_path / "d.json"), "--plain", str(tmp_path / "d.json"),
                 "--profile", str(tmp_path / "lin.yaml")]) != 0
    two = linear_profile(name="two", drafters={"x": DrafterCost(pass_s=0.001), "y": DrafterCost(pass_s=0.002)})
    two.save(tmp_path / "two.yaml")
    assert main(["simulate", "compare", str(tmp_path / "d.json"), "--plain", str(tmp_path / "plain.json"),
                 "--profile", str(tmp_path / "two.yaml")]) != 0
    assert "has no cost for drafter 'd'" in capsys.readouterr().err
