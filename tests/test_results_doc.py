"""Results pages generated from suite records: rendering, stale blocks found and rewritten, the repository in sync."""

import json
from pathlib import Path

import pytest

from draftsmith.eval import results_doc as rd


def _row(method, sampling, tps, tau, plain, fastest="plain (ours)", speedups=None):
    return {"set": "mt-bench", "sampling": sampling, "method": method, "plain": plain, "prompts": 80,
            "max_new_tokens": 128, "tokens": 10240, "tokens_per_s": tps, "tau": tau, "acceptance_rate": None,
            "acceptance_by_position": [] if plain else [0.5, 0.25, 0.125, 0.1, 0.05, 0.01, 0.0, 0.0, 0.0],
            "accepted_hist": [] if plain else list(range(20)), "draft_ms_per_step": None if plain else 1.5,
            "speedup": speedups or {}, "fastest_plain": fastest, "extra": "dropped"}


def _suite():
    env = {"torch": "2.13.0+cpu", "transformers": "5", "torch_threads": 2, "python": "3.11", "platform": "x",
           "machine": {"cpu_kind": "AMD EPYC (AVX-512)", "cpu_family": "25", "cpu_model_number": "17",
                       "cpu_count": 2, "memory_gib": 23.5},
           "code": {"commit": "abc1234", "dirty": False}}
    lc = "llama.cpp plain (shipped q4_k_m)"
    rows = [_row("plain (ours)", "greedy", 20.0, 1.0, True, lc, {"plain (ours)": 1.0, lc: 0.83}),
            _row("plain (ours, float32)", "greedy", 19.0, 1.0, True, lc, {"plain (ours)": 0.95, lc: 0.79}),
            _row("ours hydra built:7", "greedy", 30.0, 1.8, False, lc, {"plain (ours)": 1.5, lc: 1.25}),
            _row(lc, "greedy", 24.0, 1.0, True, lc, {"plain (ours)": 1.2, lc: 1.0}),
            _row("plain (ours)", "T=1", 19.0, 1.0, True, speedups={"plain (ours)": 1.0}),
            _row("ours hydra built:7", "T=1", 24.7, 1.6, False, speedups={"plain (ours)": 1.3})]
    return {"command": "draftsmith bench suite CK --sets mt-bench", "date": "2026-12-07 12:00 UTC", "environment": env,
            "target": {"name": "qwen", "fingerprint": "sha256:x", "dtype": "bfloat16"}, "sets": ["mt-bench"],
            "unavailable": {"gsm8k": "no package ships it"}, "rows": rows, "wall_s": 10,
            "forecasts": [{"set": "mt-bench", "sampling": "greedy", "method": "ours hydra built:7",
                           "source": "trees stage", "forecast_tau": 1.9, "measured_tau": 1.8, "tau_ratio": 0.947}]}


def test_record_trims_and_render_names_machine_date_command():
    rec = rd.record_of(_suite())
    assert "extra" not in rec["rows"][0] and len(rec["rows"][2]["acceptance_by_position"]) == 8
    assert len(rec["rows"][2]["accepted_hist"]) == 16 and "python" not in rec["environment"]
    text = rd.render(rec)
    assert "AMD EPYC (AVX-512), family 25 model 17" in text and "2026-12-07" in text and "abc1234" in text
    assert "    draftsmith bench suite CK --sets mt-bench" in text
    line = next(x for x in text.splitlines() if x.startswith("| ours hydra built:7"))
    assert line == ("| ours hydra built:7 | 30.00 | 1.800 | 0.50, 0.25, 0.12 | 1.50x | 1.25x | 24.70 | 1.600 | "
                    "0.50, 0.25, 0.12 | 1.30x | 1.30x |")
    assert "greedy: ours = plain (ours), any engine = llama.cpp plain" in text
    assert "| mt-bench | greedy | ours hydra built:7 | trees stage | 1.900 | 1.800 | 0.947 |" in text
    assert "gsm8k" not in text  # sets that did not run are named on the suite's own page, not here
    with pytest.raises(ValueError, match="not a suite.json"):
        rd.record_of({"rows": []})


def test_sync_finds_rewrites_and_refuses(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.json").write_text(json.dumps(rd.record_of(_suite())))
    page = tmp_path / "results.md"
    page.write_text("# R\n\n<!-- generated from results/a.json -->\nold text\n<!-- end generated -->\n\nafter\n")
    assert rd.sync(page, tmp_path / "results", write=False) == ["a"]
    assert "old text" in page.read_text()  # check does not write
    assert rd.sync(page, tmp_path / "results", write=True) == ["a"]
    text = page.read_text()
    assert "old text" not in text and text.endswith("<!-- end generated -->\n\nafter\n") and "| plain (ours) |" in text
    assert rd.sync(page, tmp_path / "results", write=False) == []
    page.write_text(text.replace("| 30.00 |", "| 31.00 |"))  # a hand edit inside a block is found
    assert rd.sync(page, tmp_path / "results", write=False) == ["a"]
    page.write_text("<!-- generated from results/missing.json -->\nx\n<!-- end generated -->\n")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        rd.sync(page, tmp_path / "results", write=False)
    page.write_text("<!-- generated from results/a.json -->\nx\n")
    with pytest.raises(ValueError, match="no '<!-- end generated -->'"):
        rd.sync(page, tmp_path / "results", write=False)


def test_the_repositorys_results_page_matches_its_records():
    """Every generated block of docs/results.md is what its committed record renders to."""
    docs = Path(__file__).resolve().parents[1] / "docs"  # the checkout's, however the package is installed
    assert rd.sync(docs / "results.md", docs / "results", write=False) == []
