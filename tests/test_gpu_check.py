"""The GPU check's own logic, on the CPU: its losslessness judgement has teeth, a failing case is recorded and the
run goes on, a spent budget skips, a rerun takes an earlier run's passes; the teacher projection a GPU target needs."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu_check import Check, decoder, drafters, enumerate_case, tiny_target
from draftsmith.common.hidden_cache import head_logits
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.exact import target_distribution

PROMPT, N_NEW = [1, 3, 4, 3], 3


@pytest.fixture(scope="module")
def t64():
    return tiny_target(torch.device("cpu"), torch.float64)


def test_exact_case_passes_a_lossless_decoder_and_catches_a_lossy_rule(t64):
    s = SamplingParams(0.8)
    ref = target_distribution(t64, PROMPT, N_NEW, s.temperature)
    d = drafters(t64, ["medusa"])["medusa"]()
    good = enumerate_case(t64, decoder(t64, d, "static", s), PROMPT, N_NEW, ref)
    assert good["ok"] and good["tv_cache_free"] < 1e-9 and good["missing"] == 0 and good["outcomes"] > 100
    bad = enumerate_case(t64, decoder(t64, d, "static", s, acceptance="typical"), PROMPT, N_NEW, ref)
    assert not bad["ok"] and bad["tv_own"] > 1e-3 and bad["tv_cache_free"] > 1e-3


def test_every_drafter_builds_and_a_chain_only_one_is_not_applicable_to_trees(t64):
    from benchmarks.gpu_check import NotApplicable
    built = {name: make() for name, make in drafters(t64).items()}
    assert {"medusa", "hydra++", "kangaroo", "standalone-rdk", "eagle3", "own-tokenizer", "suffix"} <= set(built)
    with pytest.raises(NotApplicable, match="chains only"):
        decoder(t64, built["own-tokenizer"], "static", SamplingParams(0.8))


def test_check_records_failures_skips_when_spent_and_reuses_earlier_passes(tmp_path):
    ck = Check(tmp_path / "a", budget_s=60, device="cpu")
    ck.begin("exact", ["exact"])
    with ck.case("raises") as rec:
        raise RuntimeError("boom")
    with ck.case("fails") as rec:
        rec["ok"] = False
    with ck.case("passes") as rec:
        rec["figure"] = 1.5
    ck.section_end = ck.elapsed()  # the section's time is spent
    with ck.case("too late") as rec:
        assert rec is None
    ck.end()
    data = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    status = {c["name"]: c["status"] for c in data["cases"]}
    assert status == {"raises": "error", "fails": "fail", "passes": "pass", "too late": "skipped"}
    assert "boom" in data["cases"][0]["error"] and "Traceback" in data["cases"][0]["traceback"]
    # a rerun takes the pass from the earlier run and runs the rest again
    again = Check(tmp_path / "b", budget_s=60, device="cpu", previous=tmp_path / "a" / "gpu_check.json")
    again.begin("exact", ["exact"])
    ran = []
    for name in ("raises", "fails", "passes"):
        with again.case(name) as rec:
            if rec is not None:
                ran.append(name)
    assert ran == ["raises", "fails"]
    reused = [c for c in again.data["cases"] if c.get("from_previous_run")]
    assert [c["name"] for c in reused] == ["passes"] and reused[0]["figure"] == 1.5


def test_head_logits_are_float32_where_the_states_are():
    head = torch.nn.Linear(4, 6, bias=False).to(torch.bfloat16)
    h = torch.randn(3, 4, dtype=torch.float16)
    out = head_logits(head, h)
    assert out.dtype == torch.float32 and out.device == h.device and out.shape == (3, 6)
    assert torch.allclose(out, head(h.to(torch.bfloat16)).float())


def test_the_scripts_links_cover_every_subpackage(tmp_path):
    """scripts/gpu_check.sh puts draftsmith on a lent GPU machine's path as links (no install there), from
    setup.py's FOLDERS. The import check it runs fails when a subpackage's link is missing (as `pipeline` once
    was, so that every `draftsmith.cli` call there failed), and passes with every link."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = root / "scripts" / "package_folders.py"
    pairs = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout.split()
    subs = dict(p.split("=") for p in pairs)
    assert {"pipeline", "cli", "engine", "train"} <= set(subs)

    def shim(leave_out: str | None, extra: str = "") -> subprocess.CompletedProcess:
        pkg = tmp_path / (leave_out or "all") / "draftsmith"
        pkg.mkdir(parents=True)
        for f in (root / "core").glob("*.py"):
            (pkg / f.name).symlink_to(f)
        for sub, folder in subs.items():
            if sub != leave_out:
                (pkg / sub).symlink_to(root / folder)
        return subprocess.run([sys.executable, str(script), "--import"], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": f"{extra}{pkg.parent}"})

    ok = shim(None)
    assert ok.returncode == 0, ok.stderr[-2000:]
    missing = shim("pipeline")
    assert missing.returncode != 0 and "pipeline" in missing.stderr
    # a lent machine lacks the server's extra (uvicorn): the subcommand that needs it is named, not a failure
    (tmp_path / "blocked" / "uvicorn").mkdir(parents=True)
    (tmp_path / "blocked" / "uvicorn" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n")
    lacking = shim("lacking", extra=f"{tmp_path / 'blocked'}{os.pathsep}")
    assert lacking.returncode == 0 and "uvicorn is not installed" in lacking.stderr, lacking.stderr[-2000:]
