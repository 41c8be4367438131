"""``draftsmith eval`` end to end on a tiny target saved as a local model directory."""

import json

import torch

from draftsmith.checkpoint import save_checkpoint
from draftsmith.cli.eval import eval_main, parse_tree
from draftsmith.engine.trees import DynamicTree, StaticTree
from draftsmith.heads.medusa.model import MedusaHeads
from tests.tiny import make_tiny_target


def test_parse_tree_specs():
    assert parse_tree("chain") is None
    assert parse_tree("dynamic:6,3") == DynamicTree(budget=6, max_depth=3)
    assert parse_tree("[[0],[1],[0,0]]") == StaticTree([(0,), (1,), (0, 0)])


def test_eval_cli_writes_report(tmp_path):
    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(target, num_heads=2)
    save_checkpoint(tmp_path / "ck", heads, target)
    out = tmp_path / "report"
    report = eval_main([str(tmp_path / "ck"), "--plain", "--drafter-layers", "1", "--hf-assisted", "--draft-len", "2",
                        "--prompts", "2", "--max-new-tokens", "6", "--temperature", "0", "0.8",
                        "--tree", "chain", "--tree", "dynamic:4,2,2", "--out", str(out)])
    saved = json.loads((out / "report.json").read_text())
    assert saved["environment"]["torch"] == torch.__version__ and "command" in saved
    for label in ("greedy", "T=0.8"):
        methods = saved["runs"][label]["methods"]
        assert set(methods) == {"plain (ours)", "HF generate", "ours first-1-layers K=2",
                                "HF assisted first-1-layers K=2", "ours medusa chain", "ours medusa dynamic:4,2,2"}
        assert methods["plain (ours)"]["tau"] == 1.0
        assert methods["HF generate"]["tau"] == 1.0  # one forward per token, counted by a hook
        assert methods["ours medusa chain"]["speedup"][0]["baseline"] == "plain (ours)"
    assert (out / "report.md").exists() and len(report["plots"]) == 6
    assert all((out / p).stat().st_size > 1000 for p in report["plots"])


def test_draftsmith_eval_exit_status(tmp_path, capsys):
    """`draftsmith eval` exits 0 after writing its report, and 2 with a one-line error for bad input."""
    from draftsmith.cli import main

    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    heads = MedusaHeads.for_target(target, num_heads=2)
    save_checkpoint(tmp_path / "ck", heads, target)
    args = ["eval", str(tmp_path / "ck"), "--prompts", "1", "--max-new-tokens", "3", "--temperature", "0",
            "--device", "cpu"]
    assert main(args + ["--tree", "chain", "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.json").exists()
    assert main(args + ["--tree", "built:4", "--out", str(tmp_path / "r2")]) == 2
    assert "no built trees" in capsys.readouterr().err
    # SuffixDecoding seeded with a data file's answers: its index saved under OUT, its counts in the report
    import json
    (tmp_path / "train.jsonl").write_text(json.dumps(
        {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
         "finished": [True]}) + "\n{broken\n")
    seeded = args + ["--tree", "chain", "--suffix", "--suffix-from-data", str(tmp_path / "train.jsonl"),
                     "--no-hf-prompt-lookup", "--out", str(tmp_path / "r3")]
    assert main(seeded) == 0
    rep = json.loads((tmp_path / "r3" / "report.json").read_text())
    assert rep["config"]["suffix_index_seeded"]["replies"] == 1
    assert rep["config"]["suffix_index_seeded"]["skipped"] == {"corrupt_rows": 1}
    assert (tmp_path / "r3" / "suffix_index" / "suffix_index.json").exists()
    assert "HF prompt-lookup K=10" not in rep["runs"]["greedy"]["methods"]
    assert "ours prompt-lookup K=10" in rep["runs"]["greedy"]["methods"]
    # --no-prompt-lookup leaves ours out too; SuffixDecoding alone and the hybrid stay
    assert main(seeded[:-1] + [str(tmp_path / "r5"), "--no-prompt-lookup"]) == 0
    names = json.loads((tmp_path / "r5" / "report.json").read_text())["runs"]["greedy"]["methods"]
    assert not any("prompt-lookup" in n for n in names) and "ours suffix" in names
    assert any("+suffix" in n for n in names), names
    assert main(seeded[:-2] + ["--suffix-index", str(tmp_path / "r3" / "suffix_index"),
                               "--out", str(tmp_path / "r4")]) == 2
    assert "--suffix-from-data goes with --suffix" in capsys.readouterr().err


def test_default_device():
    import pytest

    from draftsmith.target import default_device

    assert default_device("cpu").type == "cpu"
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            default_device("cuda")


def test_eval_on_a_users_prompts_file(tmp_path, capsys):
    import pytest

    from draftsmith.eval.mtbench import user_prompts

    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    heads = MedusaHeads.for_target(target, num_heads=2)
    save_checkpoint(tmp_path / "ck", heads, target)
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join([
        json.dumps({"prompt": "sort a list", "category": "code"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                 {"role": "user", "content": "more"}, {"role": "assistant", "content": "x"}],
                    "category": "chat"}),
        json.dumps({"turns": ["first", "second"]}),
        "{broken",
        json.dumps({"prompt": ""}),
        json.dumps({"messages": [{"role": "user"}]}),
    ]) + "\n")
    prompts, bad = user_prompts(target.tokenizer, f)
    assert [(p.category, p.text) for p in prompts] == [("code", "sort a list"), ("chat", "more"), ("user", "first")]
    assert bad["skipped"] == {"invalid JSON": 1, "no non-empty 'prompt', 'turns' or 'messages'": 1,
                              "messages need role and content strings": 1}
    # the chat prompt keeps its history and ends with the assistant header
    assert target.tokenizer.decode(prompts[1].ids).count("<|im_start|>") == 5
    out = tmp_path / "rep"
    eval_main([str(tmp_path / "ck"), "--prompts-file", str(f), "--max-new-tokens", "4", "--temperature", "0",
               "--out", str(out)])
    saved = json.loads((out / "report.json").read_text())
    run = saved["runs"]["greedy"]
    assert run["prompts"] == 3
    assert set(run["methods"]["ours medusa chain"]["tau_by_category"]) == {"code", "chat", "user"}
    assert "skipped 3 lines" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{bad\n")
    with pytest.raises(ValueError, match="no usable prompt"):
        user_prompts(target.tokenizer, empty)


def test_tree_specs_per_checkpoint():
    """--tree NAME=SPEC goes to the checkpoint of that recipe name only; plain specs go to every checkpoint."""
    from draftsmith.eval.compare import tree_specs_for

    specs = ["chain", "kg=[[0],[1]]", "hydra=built:best", "[[0],[1],[2]]", "runs/a=b/tree.json"]
    assert tree_specs_for(specs, "kg") == ["chain", "[[0],[1]]", "[[0],[1],[2]]", "runs/a=b/tree.json"]
    assert tree_specs_for(specs, "hydra") == ["chain", "built:best", "[[0],[1],[2]]", "runs/a=b/tree.json"]
    assert tree_specs_for(["kg=[[0]]"], "other") == ["chain"]  # nothing for it: the default
