import json

import pytest
import torch

from draftsmith.checkpoint import CheckpointError, load_checkpoint, read_manifest, save_checkpoint
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.target import TargetMismatchError, load_target
from tests.tiny import make_tiny_target


def _heads(t, share=True):
    m = MedusaHeads.for_target(t, num_heads=2, share_lm_head=share)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.normal_()
    return m


@pytest.mark.parametrize("share", [True, False])
def test_roundtrip_without_pickle(tiny_target, tmp_path, share):
    m = _heads(tiny_target, share)
    save_checkpoint(tmp_path / "ck", m, tiny_target, recipe={"name": "r"}, metrics={"a": 1})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    man = read_manifest(tmp_path / "ck")
    assert man["kind"] == "medusa" and man["target"]["fingerprint"] == tiny_target.fingerprint
    assert man["command"] and man["recipe"] == {"name": "r"}
    m2, _ = load_checkpoint(tmp_path / "ck", tiny_target)
    h = torch.randn(3, tiny_target.hidden_size)
    torch.testing.assert_close(m2(h), m(h))
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "ck" / "model.safetensors")).keys()
    assert any("lm_head" in k for k in keys) is False  # the shared head is never duplicated
    assert any(k.startswith("proj") for k in keys) is (not share)


def test_checkpoint_of_another_target_fails_clearly(tiny_target, tmp_path):
    save_checkpoint(tmp_path / "ck", _heads(tiny_target), tiny_target)
    other = make_tiny_target(seed=1)
    with pytest.raises(TargetMismatchError, match="trained for target fingerprint"):
        load_checkpoint(tmp_path / "ck", other)


def test_local_hf_directory_is_a_target(tmp_path):
    t = make_tiny_target(save_to=tmp_path / "m")
    loaded = load_target(tmp_path / "m")
    assert loaded.fingerprint == t.fingerprint
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_target(tmp_path / "nothing-here")


def _saved(tmp_path):
    """A checkpoint of a target saved as a local directory (so the CLI can load the target from the manifest)."""
    t = make_tiny_target(save_to=tmp_path / "tiny")
    t = load_target(tmp_path / "tiny")
    save_checkpoint(tmp_path / "ck", _heads(t), t)
    return t, tmp_path / "ck"


def test_truncated_weights_are_named_by_load_and_by_eval(tmp_path, capsys):
    from draftsmith.cli import main
    t, ck = _saved(tmp_path)
    w = ck / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: the header describes \d+ bytes of "
                                              r"tensor data, the file holds \d+"):
        load_checkpoint(ck, t)
    assert main(["eval", str(ck), "--prompts", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "ev")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftsmith")]
    assert len(err) == 1 and f"{w}: truncated" in err[0]


@pytest.mark.parametrize("damage,message", [
    (lambda ck: (ck / "model.safetensors").write_bytes(b""), "model.safetensors: truncated or empty"),
    (lambda ck: (ck / "model.safetensors").write_bytes(b"\xff" * 64), "model.safetensors: truncated or not a "
                                                                      "safetensors file"),
    (lambda ck: (ck / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"not json" + b"\0" * 8),
     "model.safetensors: corrupt safetensors header"),
    (lambda ck: (ck / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda ck: (ck / "config.json").unlink(), "config.json: missing"),
    (lambda ck: (ck / "config.json").write_text('{"kind": "medusa", '), "config.json: malformed JSON at line 1"),
    (lambda ck: (ck / "config.json").write_text('{"kind": "nope"}'),
     "config.json: unknown drafter kind 'nope'; known kinds"),
    (lambda ck: (ck / "config.json").write_text(json.dumps({"kind": "medusa", "hidden_size": 32, "vocab_size": 96,
                                                             "num_heads": 3, "num_layers": 1})),
     r"model.safetensors does not match kind 'medusa': missing \['blocks.2.0.linear.weight'"),
    (lambda ck: (ck / "config.json").write_text(json.dumps({"kind": "medusa", "hidden_size": 32, "vocab_size": 96,
                                                             "num_heads": 2, "num_layers": 1, "bogus": 1})),
     "config.json: does not describe a 'medusa' drafter for this target"),
    (lambda ck: (ck / "manifest.json").write_text(""), r"manifest.json: malformed JSON .* \(empty file\)"),
    (lambda ck: (ck / "manifest.json").write_text('{"kind": "medusa"}'), "manifest.json: no 'target.fingerprint'"),
    (lambda ck: (ck / "manifest.json").write_text("[1, 2]"), "manifest.json: expected a JSON object, found list"),
], ids=["empty", "garbage", "bad-header", "no-weights", "no-config", "bad-config", "unknown-kind", "more-heads",
        "bad-config-key", "empty-manifest", "manifest-no-fingerprint", "manifest-list"])
def test_corrupt_or_partial_checkpoint_names_the_file(tmp_path, damage, message):
    t, ck = _saved(tmp_path)
    damage(ck)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ck, t)


def test_info_on_malformed_manifest_is_one_line_exit_2(tmp_path, capsys):
    from draftsmith.cli import main
    _, ck = _saved(tmp_path)
    (ck / "manifest.json").write_text('{"kind": "medusa",\n  "target": ')
    assert main(["info", str(ck)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftsmith")]
    assert err == [f"draftsmith: error: {ck / 'manifest.json'}: malformed JSON at line 2 column 13: Expecting value "
                   f"(checkpoint manifest)"]
    with pytest.raises(FileNotFoundError, match="not a draftsmith checkpoint"):  # still a FileNotFoundError
        read_manifest(tmp_path)
