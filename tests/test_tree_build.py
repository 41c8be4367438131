"""Trees built from measured acceptance: the greedy growth, its expected value, and its validity."""

import itertools

import pytest

from draftsmith.engine.trees import StaticTree
from draftsmith.engine.tree_build import add_heldout_forecast, build_trees, chain_value, grow_tree, tree_value

ACC = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.05]]


def test_hand_computed_tree():
    paths, ev = grow_tree(ACC, 4)
    # (0)=.6; then (0,0)=.24 beats (1)=.2; then (1)=.2; then (2)=.1 beats (0,1)=.09 and (1,0)=.08
    assert paths == [(0,), (0, 0), (1,), (2,)]
    assert ev == pytest.approx(1 + 0.6 + 0.24 + 0.2 + 0.1)
    assert tree_value(ACC, paths) == pytest.approx(ev)


def _valid(paths):
    StaticTree(paths)  # raises on a missing parent or a gap in sibling ranks
    return True


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_greedy_tree_is_optimal_among_all_small_trees(budget):
    """Brute force over every valid tree of the same size (rank < 3, depth <= 3)."""
    paths, ev = grow_tree(ACC, budget)
    assert _valid(paths) and len(paths) == budget
    nodes = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    best = 0.0
    for cand in itertools.combinations(nodes, budget):
        s = set(cand)
        ok = all((p[:-1] in s or len(p) == 1) and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in s) for p in cand)
        if ok:
            best = max(best, tree_value(ACC, list(cand)))
    assert ev == pytest.approx(best)


def test_built_tree_beats_chain_of_same_size_in_expectation():
    t = build_trees(ACC, [3], {})
    assert t["trees"]["3"]["expected_tau"] >= chain_value(ACC, 3)
    with pytest.raises(ValueError):
        grow_tree(ACC, 0)


def test_load_tree_missing_file_or_budget_names_the_fix(tmp_path):
    import json

    from draftsmith.engine.tree_build import TREES, load_tree

    with pytest.raises(FileNotFoundError, match="draftsmith trees"):
        load_tree(tmp_path, 8)
    (tmp_path / TREES).write_text(json.dumps(build_trees(ACC, [3, 5], {})))
    assert len(load_tree(tmp_path, 3)) == 3
    with pytest.raises(ValueError, match=r"budgets \['3', '5'\], not 4.*tree_budgets=\[3, 5, 4\]"):
        load_tree(tmp_path, 4)


def test_best_tree_is_chosen_by_measured_step_cost(tmp_path):
    import json

    import pytest

    from draftsmith.engine.tree_build import build_trees, load_tree, measure_step_cost, save_trees
    from tests.tiny import make_tiny_target

    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]
    # a machine where every extra node is expensive: the smallest tree wins
    costly = build_trees(acc, [1, 3, 6], {"sequences": 1}, step_cost={"1": 1.1, "3": 2.0, "6": 4.0})
    assert costly["best"] == "1"
    # a GPU-like machine where nodes are nearly free: the largest tree wins
    free = build_trees(acc, [1, 3, 6], {"sequences": 1}, step_cost={"1": 1.0, "3": 1.01, "6": 1.02})
    assert free["best"] == "6"
    assert free["trees"]["6"]["relative_speed"] == pytest.approx(free["trees"]["6"]["expected_tau"] / 1.02)
    save_trees(tmp_path, free)
    assert load_tree(tmp_path, "best") == load_tree(tmp_path, 6)
    no_cost = build_trees(acc, [1, 3], {"sequences": 1})
    save_trees(tmp_path, no_cost)
    with pytest.raises(ValueError, match="without measured step costs"):
        load_tree(tmp_path, "best")
    t = make_tiny_target()
    cost = measure_step_cost(t, [1, 4], prefix=16, repeats=2)
    assert set(cost) == {"1", "4"} and all(v > 0 for v in cost.values())
    json.dumps(cost)


def test_drafting_cost_per_level_picks_shallower_trees():
    from draftsmith.engine.tree_build import tree_depth
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.45, 0.1, 0.05]]
    verify = {"6": 1.1}
    free = build_trees(acc, [6], {}, step_cost=verify, draft_cost={"fixed": 0.0, "per_depth": 0.0})
    assert free["trees"]["6"]["expected_tau"] == pytest.approx(grow_tree(acc, 6)[1])  # costless: the greedy tree
    assert tree_depth(free["trees"]["6"]["paths"]) == 3 and free["pays"]
    # one drafter call per level as dear as a fifth of a target step: a depth-1 star wins
    dear = build_trees(acc, [6], {}, step_cost=verify, draft_cost={"fixed": 0.1, "per_depth": 0.2})
    t = dear["trees"]["6"]
    assert tree_depth(t["paths"]) < 3 and t["expected_tau"] < free["trees"]["6"]["expected_tau"]
    assert t["step_cost"] == pytest.approx(1.1 + 0.1 + 0.2 * tree_depth(t["paths"]))
    assert t["relative_speed"] == pytest.approx(t["expected_tau"] / t["step_cost"]) and t["verify_cost"] == 1.1
    # depth-limited alternatives are all worse than what was picked
    for d in (1, 2, 3):
        p, ev = grow_tree(acc[:d], 6)
        assert ev / (1.1 + 0.1 + 0.2 * tree_depth(p)) <= t["relative_speed"] + 1e-12
    # a drafter too slow for any tree to pay: said so
    slow = build_trees(acc, [6], {}, step_cost=verify, draft_cost={"fixed": 1.0, "per_depth": 1.0})
    assert slow["pays"] is False


def test_measure_draft_cost_on_a_head_drafter():
    from draftsmith.heads.decode import HeadDrafter
    from draftsmith.engine.tree_build import measure_draft_cost
    from tests.test_decoder import tiny
    from tests.test_hydra import random_hydra
    t = tiny(vocab=20, seed=2, std=0.5)
    dc = measure_draft_cost(t, HeadDrafter(random_hydra(t, num_heads=3), t.fingerprint), 3, prompt_len=8,
                            new_tokens=12)
    assert set(dc) == {"fixed", "per_depth"} and all(v >= 0 for v in dc.values())  # no timing asserted


def test_bench_puts_the_trees_forecast_beside_its_measurement(tmp_path):
    """The bench stage's `forecast_vs_measured`: the built tree's expected tau and relative speed (trees.json)
    beside the measured ones of the method decoded with it; chains, other trees and missing files give nothing."""
    import json

    from draftsmith.eval.bench import BASELINE
    from draftsmith.pipeline.stages import forecast_vs_measured
    (tmp_path / "trees.json").write_text(json.dumps({"best": "7", "trees": {
        "3": {"expected_tau": 1.4, "relative_speed": 1.3}, "7": {"expected_tau": 1.6, "relative_speed": 1.25}}}))
    figures = {"methods": {BASELINE: {"tokens_per_s": 10.0, "tau": 1.0},
                           "ours d built:best": {"tokens_per_s": 11.0, "tau": 1.44},
                           "ours d built:3": {"tokens_per_s": 12.0, "tau": 1.4},
                           "ours d chain": {"tokens_per_s": 9.0, "tau": 1.2}}}
    got = forecast_vs_measured(figures, tmp_path, ["built:best", "built:3", "chain"], "d")
    assert set(got) == {"ours d built:best", "ours d built:3"}
    b = got["ours d built:best"]
    assert b["tree"] == "built:7" and b["forecast_tau"] == 1.6 and b["tau_ratio"] == 0.9
    assert b["measured_speedup"] == 1.1 and b["speedup_ratio"] == 0.88
    assert got["ours d built:3"]["tau_ratio"] == 1.0
    assert "step_cost_ratio" not in b  # no step times measured: no split
    # with step times: the speed's miss split into tau, step cost and the rest, whose product it is
    (tmp_path / "trees.json").write_text(json.dumps({"best": "7", "trees": {
        "7": {"expected_tau": 1.6, "relative_speed": 1.6 / 1.1, "step_cost": 1.1}}}))
    figures["methods"][BASELINE]["step_ms"] = {"draft": 0.0, "verify": 10.0, "other": 0.0}
    figures["methods"]["ours d built:best"]["step_ms"] = {"draft": 2.0, "verify": 11.0, "other": 0.2}
    b = forecast_vs_measured(figures, tmp_path, ["built:best"], "d")["ours d built:best"]
    assert b["measured_step_cost"] == 1.32 and b["step_cost_ratio"] == 1.2
    assert b["rest_ratio"] == pytest.approx(1.1 / (1.44 / 1.32), abs=1e-3)
    assert b["speedup_ratio"] == pytest.approx(b["tau_ratio"] / b["step_cost_ratio"] * b["rest_ratio"], abs=2e-3)
    assert forecast_vs_measured(figures, tmp_path / "none", ["built:best"], "d") == {}


def test_a_held_out_forecast_prices_the_same_trees_and_chooses_nothing():
    """`add_heldout_forecast`: each built tree's tau under the other set's acceptance, its speed at the tree's own
    measured step cost; the trees, their calibration forecast and the best tree stay as the calibration built them."""
    import copy
    built = build_trees(ACC, [2, 4], {}, step_cost={"2": 1.1, "4": 1.2})
    before = copy.deepcopy(built)
    held = [[0.4, 0.1, 0.05], [0.3, 0.1, 0.0], [0.2, 0.05, 0.0]]  # a harder set, as the bench's prompts are
    add_heldout_forecast(built, held, {"split": "MT-Bench", "positions": [10, 8, 6]})
    for b, t in built["trees"].items():
        assert t["paths"] == before["trees"][b]["paths"] and t["expected_tau"] == before["trees"][b]["expected_tau"]
        assert t["heldout_expected_tau"] == pytest.approx(tree_value(held, [tuple(p) for p in t["paths"]]))
        assert t["heldout_expected_tau"] < t["expected_tau"]
        assert t["heldout_relative_speed"] == pytest.approx(t["heldout_expected_tau"] / t["step_cost"])
    assert built["best"] == before["best"] and built["heldout"]["rank_acc"] == held
    assert built["chain_heldout_expected_tau"]["2"] == pytest.approx(1 + 0.4 + 0.4 * 0.3)


def test_the_bench_sets_the_held_out_forecast_beside_its_measurement(tmp_path):
    import json

    from draftsmith.eval.bench import BASELINE
    from draftsmith.pipeline.stages import forecast_vs_measured
    (tmp_path / "trees.json").write_text(json.dumps({"best": "7", "trees": {"7": {
        "expected_tau": 1.6, "relative_speed": 1.6 / 1.1, "step_cost": 1.1,
        "heldout_expected_tau": 1.5, "heldout_relative_speed": 1.5 / 1.1}}}))
    figures = {"methods": {BASELINE: {"tokens_per_s": 10.0, "tau": 1.0},
                           "ours d built:best": {"tokens_per_s": 12.0, "tau": 1.44}}}
    b = forecast_vs_measured(figures, tmp_path, ["built:best"], "d")["ours d built:best"]
    assert b["tau_ratio"] == 0.9 and b["heldout_forecast_tau"] == 1.5 and b["heldout_tau_ratio"] == 0.96
    assert b["heldout_forecast_speedup"] == pytest.approx(1.364, abs=1e-3)
    assert b["heldout_speedup_ratio"] == pytest.approx(1.2 / (1.5 / 1.1), abs=1e-3)


def test_a_forecast_from_too_few_held_out_sequences_is_called_noise():
    from draftsmith.pipeline.stages import FORECAST_MIN_SEQUENCES, forecast_warning
    assert "only 2 held-out" in forecast_warning({"sequences": 2})
    assert forecast_warning({"sequences": FORECAST_MIN_SEQUENCES}) is None
