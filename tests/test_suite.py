"""``draftsmith bench suite``: the evaluation protocol's sets, figures and tables, on a tiny target."""

import json

import pytest
import torch

from draftsmith.checkpoint import save_checkpoint
from draftsmith.engine.metrics import StepStats, accepted_histogram
from draftsmith.eval.bench import add_plain
from draftsmith.eval.mtbench import spread
from draftsmith.eval.suite import UNAVAILABLE
from draftsmith.heads.medusa.model import MedusaHeads
from tests.tiny import make_tiny_target


def _step(accepted: int, drafted: int) -> StepStats:
    return StepStats(emitted=accepted + 1, accepted=accepted, attempted=min(drafted, accepted + 1), drafted=drafted,
                     draft_s=0.0, verify_s=0.0, other_s=0.0)


def test_accepted_histogram_counts_steps_by_accepted_drafts():
    assert accepted_histogram([_step(0, 3), _step(2, 3), _step(2, 3), _step(3, 3)]) == [1, 0, 2, 1]
    assert accepted_histogram([]) == []


def test_another_engines_plain_decoding_becomes_every_methods_baseline():
    figs = {"methods": {"plain (ours)": {"tokens_per_s": 10.0}, "ours x chain": {"tokens_per_s": 15.0}}}
    add_plain(figs, "llama.cpp plain (q4_1)", {"tokens_per_s": 20.0})
    sp = {x["baseline"]: x["speedup"] for x in figs["methods"]["ours x chain"]["speedup"]}
    assert sp == {"plain (ours)": 1.5, "llama.cpp plain (q4_1)": 0.75}
    assert figs["fastest_plain"] == "llama.cpp plain (q4_1)"
    with pytest.raises(ValueError, match="not named as a plain decoding"):
        add_plain(figs, "vllm", {"tokens_per_s": 1.0})


def test_spread_covers_the_file_and_refuses_zero():
    assert spread(list(range(10)), 3) == [0, 3, 6]
    assert spread(list(range(4)), None) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="at least one prompt"):
        spread(list(range(4)), 0)


def test_bench_suite_end_to_end(tmp_path, capsys):
    from draftsmith.cli import main

    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    torch.manual_seed(0)
    probe = {"step": 4, "tau_sim": 1.5, "tau_real": 1.4}  # what a training-time probe leaves in the manifest
    save_checkpoint(tmp_path / "ck", MedusaHeads.for_target(target, num_heads=2), target,
                    metrics={"training_timing": {"probes": [probe]}})
    # what the trees stage leaves: a built tree, its forecast on the calibration split and on the held-out answers
    (tmp_path / "ck" / "trees.json").write_text(json.dumps({"best": "2", "trees": {"2": {
        "paths": [[0], [0, 0]], "expected_tau": 1.5, "step_cost": 1.25, "relative_speed": 1.2,
        "heldout_expected_tau": 1.4, "heldout_relative_speed": 1.12}}}))
    out = tmp_path / "suite"
    args = ["bench", "suite", str(tmp_path / "ck"), "--quick", "--prompts", "2", "--max-new-tokens", "4",
            "--first-answer-tokens", "3", "--no-hf", "--no-vllm", "--llamacpp", "", "--device", "cpu",
            "--sets", "mt-bench", "mt-bench-2", "humaneval", "gsm8k", "--out", str(out)]
    assert main(args) == 0
    assert "set gsm8k: not run" in capsys.readouterr().out
    suite = json.loads((out / "suite.json").read_text())
    assert suite["sets"] == ["mt-bench", "mt-bench-2", "humaneval"] and set(suite["unavailable"]) == set(UNAVAILABLE)
    env = suite["environment"]
    assert env["machine"]["cpu_count"] and "cpu_kind" in env["machine"] and suite["command"] and suite["date"]
    rows = {(r["set"], r["sampling"], r["method"]): r for r in suite["rows"]}
    for s in suite["sets"]:
        for label in ("greedy", "T=1.0"):
            plain, heads = rows[(s, label, "plain (ours)")], rows[(s, label, "ours medusa chain")]
            assert plain["tau"] == 1.0 and plain["speedup"]["plain (ours)"] == 1.0
            assert heads["prompts"] == 2 and heads["max_new_tokens"] == 4
            # every step is in the histogram; the acceptance rate is accepted / drafted over those steps
            hist = heads["accepted_hist"]
            steps = sum(hist)
            accepted = sum(k * c for k, c in enumerate(hist))
            assert steps > 0 and heads["acceptance_rate"] == pytest.approx(accepted / (heads["mean_draft_len"] * steps))
            assert heads["tau"] == pytest.approx(heads["tokens"] / steps)
            assert heads["speedup"]["plain (ours)"] == pytest.approx(heads["tokens_per_s"] / plain["tokens_per_s"])
    # the training probe's prediction beside the chain's tau, per set and sampling
    fc = {(f["set"], f["sampling"], f["source"]): f for f in suite["forecasts"]}
    assert len(fc) == 18 and fc[("humaneval", "greedy", "training probe (step 4)")]["forecast_tau"] == 1.5
    got = rows[("humaneval", "greedy", "ours medusa chain")]["tau"]
    assert fc[("humaneval", "greedy", "training probe (step 4)")]["tau_ratio"] == pytest.approx(got / 1.5, abs=1e-3)
    # ... and the built tree's forecasts beside its measurement: the calibration split's, and the held-out answers'
    tree = rows[("humaneval", "greedy", "ours medusa built:best")]["tau"]
    calib = fc[("humaneval", "greedy", "trees stage")]
    held = fc[("humaneval", "greedy", "trees stage, held-out MT-Bench answers")]
    assert calib["forecast_tau"] == 1.5 and calib["tau_ratio"] == pytest.approx(tree / 1.5, abs=1e-3)
    assert held["forecast_tau"] == 1.4 and held["tau_ratio"] == pytest.approx(tree / 1.4, abs=1e-3)
    assert held["forecast_speedup"] == 1.12 and not any(k.startswith("heldout_") for k in calib)
    # second turns: the target's own first answer sits between the two user turns, kept for a rerun
    answers = [json.loads(x) for x in (out / "mt_bench_first_answers.jsonl").read_text().splitlines()]
    assert len(answers) == 2 and answers[0]["key"]["max_new_tokens"] == 3
    md = (out / "suite.md").read_text()
    assert "## mt-bench-2, T=1.0: 2 prompts x 4 tokens" in md and "Machine: " in md and "Command: `" in md
    assert "gsm8k: not run" in md and len(suite["plots"]) == 2
    assert all((out / s / "report.json").exists() for s in suite["sets"])
    assert main(args[:-2] + ["--out", str(out)]) == 0  # the rerun reuses the first answers it kept
    assert len((out / "mt_bench_first_answers.jsonl").read_text().splitlines()) == 2
    assert main(["bench", "suite", "none", "--sets", "alpaca", "--out", str(tmp_path / "x")]) == 2
    assert "no set to run" in capsys.readouterr().err


def test_second_turn_prompts_carry_the_first_answer(tmp_path):
    from draftsmith.eval.suite import mtbench_second_turns

    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3)
    prompts = mtbench_second_turns(target, 1, 3, tmp_path)
    row = json.loads((tmp_path / "mt_bench_first_answers.jsonl").read_text())
    text = target.tokenizer.decode(prompts[0].ids)
    assert row["answer"] in text and prompts[0].text in text
    assert text.index(row["answer"]) < text.index(prompts[0].text)


def test_the_machine_is_read_from_cpuinfo():
    from draftsmith.machine import cpu_kind, cpu_stamp, git_commit

    info = ("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n"
            "flags\t\t: fpu sse4_2 avx avx2 fma bmi2\n\nprocessor\t: 1\nmodel name\t: other\n")
    s = cpu_stamp(info)
    assert (s["cpu_model"], s["cpu_family"], s["cpu_model_number"]) == ("AMD EPYC 7B13", "25", "1")
    assert s["cpu_isa"] == ["avx", "avx2", "bmi2", "fma", "sse4_2"]
    assert cpu_kind(s) == "AMD EPYC 7B13 (AVX2 only)"
    assert cpu_kind({"cpu_model": "Xeon", "cpu_isa": ["avx512f", "amx_tile"]}) == "Xeon (AMX)"
    assert cpu_kind({"cpu_model": "", "cpu_isa": ["avx512f"]}) == "unknown CPU (AVX-512)"
    assert git_commit("/") is None  # not a checkout


def test_two_runs_of_one_recipe_get_their_run_names(tmp_path):
    """Checkpoints whose recipes share a name (one recipe trained twice) are told apart by their run directories,
    not refused as duplicate methods."""
    from draftsmith.cli import main

    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    for run in ("run-a", "run-b"):
        save_checkpoint(tmp_path / run / "final", MedusaHeads.for_target(target, num_heads=2), target)
    out = tmp_path / "suite"
    assert main(["bench", "suite", str(tmp_path / "run-a" / "final"), str(tmp_path / "run-b" / "final"), "--quick",
                 "--prompts", "1", "--max-new-tokens", "3", "--no-hf", "--no-vllm", "--llamacpp", "", "--device",
                 "cpu", "--sets", "mt-bench", "--out", str(out)]) == 0
    methods = {r["method"] for r in json.loads((out / "suite.json").read_text())["rows"]}
    assert {"ours medusa chain", "ours medusa (run-b) chain"} <= methods


def test_eval_times_float32_plain_decoding_beside_another_dtype(tmp_path):
    """``--plain-float32``: our plain decoding in float32 joins a bf16 run as one more plain baseline (every method's
    speedup names it), on a CPU by default; ``off`` leaves it out."""
    from draftsmith.cli import main

    make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    base = ["eval", "none", "--target", str(tmp_path / "target"), "--dtype", "bfloat16", "--prompts", "2",
            "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu", "--forward", "fast"]
    methods = {}
    for want in ("auto", "off"):
        assert main(base + ["--plain-float32", want, "--out", str(tmp_path / want)]) == 0
        methods[want] = json.loads((tmp_path / want / "report.json").read_text())["runs"]["greedy"]["methods"]
    on = methods["auto"]
    assert set(on) == {"plain (ours)", "plain (ours, float32)"} and set(methods["off"]) == {"plain (ours)"}
    assert on["plain (ours, float32)"]["tokens"] > 0
    # every method names both plain decodings, whichever was faster this run (no timing decides what is listed)
    assert all([x["baseline"] for x in m["speedup"]] == ["plain (ours)", "plain (ours, float32)"] for m in on.values())
