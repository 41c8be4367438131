import json

import pytest
import torch

from draftsmith.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.target import TargetMismatchError, load_target
from tests.tiny import make_tiny_target


def _heads(t, share=True):
    m = MedusaHeads(t.hidden_size, t.vocab_size, t.lm_head, num_heads=2, share_lm_head=share)
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
