"""Sharding and merging of the greedy-equality script's reports (no model needed)."""

import json

import pytest

from draftsmith.eval.greedy_equality import first_divergence, main, merge_reports, parse_shard


def _report(shard, prompts, equal, divs, unexplained=0, tokens=128):
    return {"prompts": prompts, "max_new_tokens": tokens, "tie_gap": 1e-3, "shard": shard, "seconds": 10.0 * prompts,
            "methods": {"chain": {"equal": equal, "divergences": divs, "unexplained": unexplained}},
            "pass": unexplained == 0, "cpu_layout": True}


def test_parse_shard():
    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "a/b", "1", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_merge_adds_counts_and_keeps_every_divergence(tmp_path):
    d = {"question_id": 90, "position": 7, "top2_gap": 2e-4, "near_tie": True}
    a, b = _report([0, 2], 40, 40, []), _report([1, 2], 40, 39, [d])
    m = merge_reports([a, b])
    assert m["prompts"] == 80 and m["methods"]["chain"]["equal"] == 79
    assert m["methods"]["chain"]["divergences"] == [d] and m["pass"] and m["seconds"] == 400.0
    bad = _report([1, 2], 40, 39, [dict(d, near_tie=False)], unexplained=1)
    assert not merge_reports([a, bad])["pass"]
    # through the command line
    for name, r in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    out = tmp_path / "all.json"
    main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)])
    assert json.loads(out.read_text())["methods"]["chain"]["equal"] == 79


def test_merge_refuses_mismatched_or_repeated_shards():
    a = _report([0, 2], 40, 40, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        merge_reports([a, _report([1, 2], 40, 40, [], tokens=64)])
    with pytest.raises(ValueError, match="same shard"):
        merge_reports([a, _report([0, 2], 40, 40, [])])
    other = _report([1, 2], 40, 40, [])
    other["methods"] = {"heads-chain": other["methods"]["chain"]}
    with pytest.raises(ValueError, match="methods"):
        merge_reports([a, other])
    with pytest.raises(ValueError, match="nothing"):
        merge_reports([])
