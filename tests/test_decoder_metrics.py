"""The metric definitions (engine/metrics.py) on hand-made step records."""

import pytest

from draftsmith.engine.metrics import (DecodeResult, StepStats, acceptance_by_position, speedup, summarize, tau,
                                     time_shares, tokens_per_second)


def _step(accepted, attempted, emitted=None, d=0.1, v=0.3, o=0.0):
    return StepStats(emitted=accepted + 1 if emitted is None else emitted, accepted=accepted, attempted=attempted,
                     drafted=4, draft_s=d, verify_s=v, other_s=o)


def test_tau_counts_bonus_and_not_prefill():
    r = DecodeResult(tokens=list(range(7)), prompt_len=3, steps=[_step(3, 4), _step(0, 1), _step(1, 2)], prefill_s=5.0)
    assert r.target_forwards == 3 and r.tau == pytest.approx(7 / 3)
    plain = DecodeResult(tokens=[1, 2, 3], prompt_len=2, steps=[_step(0, 0) for _ in range(3)])
    assert plain.tau == 1.0
    assert tau(0, 0) == 0.0


def test_acceptance_by_position_is_conditional():
    # depth 1 tested in 4 steps, accepted in 3; depth 2 tested in 3 (those that reached it), accepted in 1;
    # depth 3 tested once (the step that accepted depth 2 and had a depth-3 candidate), rejected.
    r = DecodeResult(tokens=[0] * 9, prompt_len=1,
                     steps=[_step(0, 1), _step(1, 2), _step(1, 2), _step(2, 3), _step(0, 0)])
    assert acceptance_by_position([r]) == [pytest.approx(3 / 4), pytest.approx(1 / 3), 0.0]
    assert acceptance_by_position([r], max_depth=1) == [pytest.approx(3 / 4)]


def test_time_shares_speedup_and_summary():
    r = DecodeResult(tokens=[0] * 4, prompt_len=1, steps=[_step(1, 2, d=0.1, v=0.3, o=0.1)] * 2, wall_s=2.0)
    assert time_shares([r]) == pytest.approx({"draft": 0.2, "verify": 0.6, "other": 0.2})
    assert tokens_per_second(10, 4.0) == 2.5
    s = speedup(30.0, 20.0, "plain (ours)")
    assert s == {"speedup": 1.5, "baseline": "plain (ours)"}
    summ = summarize([r, r])
    assert summ["tokens"] == 8 and summ["target_forwards"] == 4 and summ["tau"] == 2.0
    assert summ["tokens_per_s"] == 2.0
    assert summ["step_ms"] == pytest.approx({"draft": 100.0, "verify": 300.0, "other": 100.0})


def test_bench_shuffles_method_order_per_prompt():
    """Interleaved, with a seeded shuffle per prompt: every method runs once per prompt, the orders differ,
    and no method always runs right after the same one."""
    from types import SimpleNamespace

    from draftsmith.eval.bench import Method, run_bench

    calls: list[str] = []

    def runner(name):
        def run(ids, n, seed):
            calls.append(name)
            return DecodeResult(tokens=[1] * n, prompt_len=len(ids),
                                steps=[StepStats(1, 0, 0, 0, 0.0, 0.01, 0.0)] * n, wall_s=0.01 * n)
        return run

    methods = [Method(m, runner(m)) for m in "abcd"]
    prompts = [SimpleNamespace(ids=[0, 1], question_id=i, category="x") for i in range(12)]
    run_bench(methods, prompts, 2, log=None)
    per_prompt = [calls[4 + 4 * k: 8 + 4 * k] for k in range(12)]  # the first 4 calls are the warm-up
    assert all(sorted(p) == list("abcd") for p in per_prompt)
    assert len({tuple(p) for p in per_prompt}) >= 6
    follows = {m: {p[p.index(m) - 1] for p in per_prompt if p.index(m) > 0} for m in "abcd"}
    assert all(len(f) >= 2 for f in follows.values()), follows
    calls.clear()
    run_bench(methods, prompts, 2, log=None)
    assert [calls[4 + 4 * k: 8 + 4 * k] for k in range(12)] == per_prompt  # seeded: the same run twice


def test_bench_forgets_the_warmup_and_takes_compile_time_out():
    """A method's ``after_warmup`` runs once, after every warm-up run (the longest prompt included) and before
    the first timed one; seconds the compile clock gains inside a timed run leave that run's wall time."""
    from types import SimpleNamespace

    from draftsmith.eval.bench import Method, run_bench

    log: list[str] = []
    clock = [0.0]

    def run(ids, n, seed):
        log.append(f"run{len(ids)}")
        if len(log) == 4:  # the second timed run meets a new graph: 5 s of compiling inside it
            clock[0] += 5.0
        return DecodeResult(tokens=[1] * n, prompt_len=len(ids), steps=[StepStats(1, 0, 0, 0, 0.0, 0.01, 0.0)] * n,
                            wall_s=6.0 if len(log) == 4 else 1.0)

    m = Method("a", run, after_warmup=lambda: log.append("forget"))
    prompts = [SimpleNamespace(ids=[0] * k, question_id=k, category="x") for k in (2, 5, 3)]
    fig = run_bench([m], prompts, 4, log=None, compile_clock=lambda: clock[0])
    assert log == ["run2", "run5", "forget", "run2", "run5", "run3"]  # warm-up: first and longest prompt
    assert fig["compile_in_timed_s"] == {"a": 5.0}
    assert fig["per_prompt"][1]["a"]["wall_s"] == pytest.approx(1.0)  # 6 s less the 5 s of compiling
