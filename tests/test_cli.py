import json

import pytest
import yaml

from draftsmith.cli import main
from draftsmith.eval.bench import is_plain
from tests.tiny import make_tiny_target


@pytest.fixture()
def tiny_dir(tmp_path):
    make_tiny_target(save_to=tmp_path / "tiny")
    return tmp_path / "tiny"


def _recipe_file(tmp_path, tiny_dir, **extra):
    data = tmp_path / "user.jsonl"
    rows = [json.dumps({"prompt": f"tell me about topic {i}"}) for i in range(30)] + ["{broken", json.dumps({"x": 1})]
    data.write_text("\n".join(rows) + "\n")
    r = {"name": "cli", "target": str(tiny_dir), "output_dir": str(tmp_path / "run"),
         "data": {"sources": [{"type": "jsonl", "path": str(data)},
                              {"type": "sharegpt", "path": "builtin:sharegpt-dummy", "max_conversations": 10}],
                  "max_new_tokens": 12, "temperature": 1.0, "batch_size": 16, "heldout_max_new_tokens": 8,
                  "on_long_prompt": "skip"},
         "drafter": {"kind": "medusa", "num_heads": 2},
         "train": {"epochs": 1, "batch_size": 2, "chunk_len": 16, "tracker": "none", "calibration_every": 4,
                   "tree_budgets": [3, 5]},
         "eval": {"prompts": 2, "max_new_tokens": 8, "trees": ["chain", "built:5"]}, **extra}
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


@pytest.mark.parametrize("drafter", [{"kind": "medusa", "num_heads": 2},
                                     {"kind": "hydra", "num_heads": 2, "num_layers": 2, "prefix_layer": True}],
                         ids=["medusa", "hydra++"])
def test_run_end_to_end_reports_and_counts_skips(tmp_path, tiny_dir, capsys, drafter):
    seeded = drafter["kind"] == "hydra"  # Hydra's run also benches SuffixDecoding seeded with the data's answers
    ev = {"prompts": 2, "max_new_tokens": 8, "trees": ["chain", "built:5"], "suffix_from_data": seeded}
    assert main(["run", str(_recipe_file(tmp_path, tiny_dir, drafter=drafter, eval=ev))]) == 0
    out = capsys.readouterr().out
    assert "skipped 2 bad rows" in out and "predicted chain acceptance length" in out
    assert "5 nodes -> expected tau" in out  # trees built from the held-out calibration split
    assert "ours cli built:5" in out and "tokens/s" in out  # decoded with the built tree, timed
    trees = json.loads((tmp_path / "run" / "final" / "trees.json").read_text())
    assert len(trees["trees"]["5"]["paths"]) == 5 and trees["source"]["sequences"] > 0
    # ... and forecast again on the held-out MT-Bench answers the report reads
    assert trees["heldout"]["positions"][0] > 0 and trees["trees"]["5"]["heldout_expected_tau"] >= 1.0
    assert "the same trees on the held-out MT-Bench answers" in out
    bench = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert bench["methods"]["ours cli built:5"]["tau"] >= 1.0
    assert ("ours cli+suffix built:5" in bench["methods"]) == seeded == ("ours suffix" in bench["methods"])
    if seeded:  # the training split's answers, saved where serve --suffix-state and eval --suffix-index read them
        train_rows = (tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()
        assert bench["suffix_index"]["conversations"] == len(train_rows) and "suffix index (" in out
        saved = json.loads((tmp_path / "run" / "suffix_index" / "suffix_index.json").read_text())
        assert len(saved["ids"]) == bench["suffix_index"]["replies"] > 0
        assert sum(saved["lengths"]) == bench["suffix_index"]["indexed_tokens"]
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert len(rep["top1"]) == 2 and rep["positions"][0] > 0
    meta = json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
    assert meta["skipped"]["by_reason"] == {"jsonl0: invalid JSON": 1, "jsonl0: no 'conversations' list": 1}
    assert main(["info", str(tmp_path / "run" / "final")]) == 0
    assert "fingerprint" in capsys.readouterr().out


def test_unknown_recipe_key_exits_2_naming_it(tmp_path, tiny_dir, capsys):
    p = _recipe_file(tmp_path, tiny_dir, trian={"epochs": 1})
    assert main(["train", str(p)]) == 2
    assert "'trian': unknown key" in capsys.readouterr().err


def test_empty_dataset_fails_clearly(tmp_path, tiny_dir, capsys):
    (tmp_path / "empty.jsonl").write_text("{bad\n\n")
    r = {"name": "e", "target": str(tiny_dir), "output_dir": str(tmp_path / "run"),
         "data": {"sources": [{"type": "jsonl", "path": str(tmp_path / "empty.jsonl")}]},
         "drafter": {"kind": "medusa"}, "train": {"tracker": "none"}}
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(r))
    assert main(["data", str(tmp_path / "e.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no usable conversations" in err and "1 rows skipped" in err


def test_teacher_forced_data_uses_the_conversations_as_they_are(tmp_path, tiny_dir, capsys):
    data = tmp_path / "logs.jsonl"
    data.write_text("\n".join([
        json.dumps({"prompt": "what is a cat", "response": "a small animal"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                 {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]}),
        json.dumps({"prompt": "no answer here"}),
    ]) + "\n")
    r = {"name": "tf", "target": str(tiny_dir), "output_dir": str(tmp_path / "run"),
         "data": {"sources": [{"type": "jsonl", "path": str(data)}], "regenerate": False, "max_turns": 2,
                  "heldout_mtbench": False},
         "drafter": {"kind": "medusa", "num_heads": 2}, "train": {"tracker": "none"}}
    (tmp_path / "tf.yaml").write_text(yaml.safe_dump(r))
    assert main(["data", str(tmp_path / "tf.yaml")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()]
    assert [r["messages"] for r in rows] == [
        [{"role": "user", "content": "what is a cat"}, {"role": "assistant", "content": "a small animal"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]]
    meta = json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
    assert meta["generation"]["skipped_no_assistant_turn"] == 1 and meta["generation"]["teacher_forced"] == 1


def test_trees_measure_step_costs_in_the_decoding_dtype(tmp_path, tiny_dir, capsys, monkeypatch):
    """Training reads the target in float32, but a bf16 recipe decodes in bf16: the trees' step costs (which pick
    built:best) are measured on the bf16 target, and the bench decodes on that same object."""
    import torch
    from draftsmith.pipeline import stages as pipeline
    seen = []
    real = pipeline.measure_step_cost
    monkeypatch.setattr(pipeline, "measure_step_cost",
                        lambda t, *a, **k: seen.append(next(t.model.parameters()).dtype) or real(t, *a, **k))
    benched = []
    real_bench = pipeline.stage_bench
    monkeypatch.setattr(pipeline, "stage_bench", lambda r, t, *a, **k:
                        benched.append(next(t.model.parameters()).dtype) or real_bench(r, t, *a, **k))
    assert main(["run", str(_recipe_file(tmp_path, tiny_dir, dtype="bfloat16"))]) == 0
    out = capsys.readouterr().out
    assert "train: the target in float32" in out
    assert seen == [torch.bfloat16] and benched == [torch.bfloat16]
    # on a CPU the bench also times plain decoding in float32 (the fastest plain decoding may be in a dtype the
    # drafters do not run in), and every speedup names the fastest plain decoding measured
    bench = json.loads((tmp_path / "run" / "bench.json").read_text())
    ms = bench["methods"]
    assert bench["dtype"] == "bfloat16" and "plain (ours, float32)" in ms and "plain (ours, float32)" in out
    fastest = bench["fastest_plain"]
    assert fastest in ms and ms[fastest]["tokens_per_s"] == max(ms[n]["tokens_per_s"] for n in ms if is_plain(n))
    assert all(any(x["baseline"] == fastest for x in m["speedup"]) for m in ms.values())


def test_bench_times_plain_in_the_other_dtype_only_when_asked(tmp_path, tiny_dir):
    """eval.plain_other_dtype: None times plain decoding on a CPU in float32 beside bf16 decoding, and in the data's
    bf16 beside float32 decoding; false never; a float32 run never twice. Its former name still reads."""
    from draftsmith.pipeline.stages import decode_choice, plain_dtypes
    from draftsmith.recipe import Recipe
    base = {"name": "x", "target": str(tiny_dir), "drafter": {"kind": "medusa"}}
    r = Recipe.model_validate(base)
    assert plain_dtypes(r, "bfloat16") == ["float32"] and plain_dtypes(r, "float32") == []
    assert plain_dtypes(r, "float32", "cpu", "bfloat16") == ["bfloat16"]
    assert plain_dtypes(r, "bfloat16", "cpu", "bfloat16") == ["float32"]
    assert plain_dtypes(r, "bfloat16", "cuda") == []
    off = Recipe.model_validate({**base, "eval": {"plain_other_dtype": False}})
    on = Recipe.model_validate({**base, "eval": {"plain_float32": True}})
    assert on.eval.plain_other_dtype is True
    assert plain_dtypes(off, "float32", "cpu", "bfloat16") == [] and plain_dtypes(on, "bfloat16", "cuda") == ["float32"]
    # a local directory ships no GGUF file: decoding keeps the recipe's dtype; eval.dtype beats it
    assert decode_choice(Recipe.model_validate({**base, "dtype": "bfloat16"})).name == "bfloat16"
    assert decode_choice(Recipe.model_validate({**base, "dtype": "bfloat16", "eval": {"dtype": "float32"}})).name == \
        "float32"


def test_the_data_stage_alone_fills_eagle3s_layers_from_the_target(tmp_path, capsys):
    """`draftsmith data` on an EAGLE-3 recipe that leaves aux_layers out: the fused cache's plan reads the layers the
    target gives (it failed after writing every prompt when only the later stages filled them in)."""
    tiny4 = tmp_path / "tiny4"
    make_tiny_target(save_to=tiny4, layers=4)
    p = _recipe_file(tmp_path, tiny4, drafter={"kind": "eagle3", "vocab_keep": 48, "ttt_steps": 2})
    assert main(["data", str(p)]) == 0
    assert main(["cache", str(p)]) == 0
    assert "needs ['layer:1', 'layer:2', 'layer:3', 'final']" in capsys.readouterr().out


def test_eagle3_run_builds_trees_from_its_steps_rank_acceptance(tmp_path, capsys):
    """The whole job with EAGLE-3: the trees stage builds static trees from the training-time steps' acceptance
    by rank on the calibration split (rank 0 of step k is the report's conditional top-1 there), and the bench
    decodes with the built tree."""
    from draftsmith.checkpoint import load_checkpoint
    from draftsmith.common.hidden_cache import HiddenCache
    from draftsmith.drafters.eagle3.objective import heldout_metrics
    from draftsmith.common.chunks import calibration_split
    from draftsmith.engine.tree_build import tree_value

    tiny4 = tmp_path / "tiny4"
    t = make_tiny_target(save_to=tiny4, layers=4)
    p = _recipe_file(tmp_path, tiny4, drafter={"kind": "eagle3", "aux_layers": [1, 2, 3], "vocab_keep": 48,
                                               "ttt_steps": 3, "draft_len": 3})
    assert main(["run", str(p)]) == 0
    out = capsys.readouterr().out
    assert "5 nodes -> expected tau" in out and "ours cli built:5" in out
    trees = json.loads((tmp_path / "run" / "final" / "trees.json").read_text())
    assert len(trees["trees"]["5"]["paths"]) == 5 and len(trees["rank_acc"]) == 3
    assert trees["source"]["conditional"] and trees["source"]["sequences"] > 0
    model, _ = load_checkpoint(tmp_path / "run" / "final", t)
    cache = HiddenCache(tmp_path / "run" / "cache" / "train", t)
    acc = model.rank_acceptance(cache, t, sequences=calibration_split(len(cache), 4), ranks=10)
    flat = lambda rows: [x for r in rows for x in r]  # noqa: E731
    assert flat(acc["rank_acc"]) == pytest.approx(flat(trees["rank_acc"]), abs=1e-9)
    assert sum(flat(acc["rank_acc"])) > 0
    assert all(sum(r) <= 1 + 1e-9 for r in acc["rank_acc"])
    held = HiddenCache(tmp_path / "run" / "cache" / "heldout", t)
    held_acc = model.rank_acceptance(held, t)["rank_acc"]
    rank0 = [r[0] for r in held_acc]
    assert rank0 == pytest.approx(heldout_metrics(model, held, t)["step_top1_conditional"], abs=1e-9)
    # the same trees forecast on the held-out set, from the steps' acceptance there
    assert flat(trees["heldout"]["rank_acc"]) == pytest.approx(flat(held_acc), abs=1e-9)
    assert trees["trees"]["5"]["heldout_expected_tau"] == pytest.approx(
        tree_value(held_acc, [tuple(q) for q in trees["trees"]["5"]["paths"]]))
