"""Exports proven in vLLM (CPU): runs only where vLLM's environment exists (`bash scripts/vllm_env.sh` builds
.venv-vllm, about 3 minutes and 1.5 GB; CI does not build it). A tiny random target, an EAGLE-3 drafter and
Medusa heads, exported, loaded by vLLM, decoded greedily: vLLM's tokens with each drafter equal vLLM's without
one and our plain decoding's; vLLM's acceptance counters are read."""

import json

import pytest
import torch

from draftsmith.checkpoint import save_checkpoint
from draftsmith.export.vllm_check import main as vllm_check, vllm_python
from draftsmith.heads.medusa.model import MedusaHeads
from tests.test_eagle3 import module
from tests.tiny import make_tiny_target

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment (.venv-vllm)")


def test_exports_decode_in_vllm_as_without_a_drafter(tmp_path):
    # vLLM's CPU attention kernels need a head size it supports (64 here: 128 hidden, 2 heads)
    t = make_tiny_target(init_std=0.3, layers=4, hidden_size=128, heads=2, kv_heads=1, save_to=tmp_path / "target")
    e3 = module(t, vocab_keep=48)
    e3.set_draft_vocab(torch.arange(48) * 2)
    save_checkpoint(tmp_path / "e3" / "final", e3, t)
    torch.manual_seed(0)
    med = MedusaHeads.for_target(t, num_heads=3)
    save_checkpoint(tmp_path / "med" / "final", med, t)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Name a colour.", "Count to five.", "Hi!")))
    rep = vllm_check(["--prompts-file", str(prompts), str(tmp_path / "e3" / "final"), str(tmp_path / "med" / "final"),
                      "--target", str(tmp_path / "target"), "--prompts", "3", "--max-new-tokens", "16",
                      "--draft-len", "3", "--out", str(tmp_path / "out")])
    assert set(rep["runs"]) == {"e3-vllm-eagle3", "med-vllm-medusa"}
    for r in rep["runs"].values():
        assert r["vllm_vs_vllm_plain"]["equal"] == 3 and r["ours_vs_ours_plain"]["equal"] == 3, r
        assert r["vllm_drafts"] > 0 and r["vllm_mean_acceptance_length"] >= 1.0


def test_a_vllm_whose_model_class_lacks_eagle3_refuses_before_a_run(tmp_path):
    """vLLM fails to load an EAGLE-3 drafter for a target whose model class lacks its EAGLE-3 interface (Gemma 3
    in vLLM 0.32) only after starting, with a traceback; the check asks vLLM's own model classes first and names
    the architecture and version. A vLLM that supports it, or that cannot be asked, is not refused."""
    from types import SimpleNamespace

    from draftsmith.export.vllm_check import table, vllm_refuses
    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(architectures=["Gemma3ForCausalLM"])))
    fake = {}
    for name, out, rc in (("lacks", "0 0.32.0", 0), ("has", "1 0.32.0", 0), ("broken", "", 1)):
        fake[name] = tmp_path / name
        fake[name].write_text(f"#!/bin/sh\necho '{out}'\nexit {rc}\n")
        fake[name].chmod(0o755)
    why = vllm_refuses(fake["lacks"], target, "eagle3")
    assert why is not None and "Gemma3ForCausalLM" in why and "0.32.0" in why
    assert "SupportsEagle3" in why and "eagle3 drafter" in why
    assert vllm_refuses(fake["has"], target, "eagle3") is None
    assert vllm_refuses(fake["broken"], target, "eagle3") is None
    assert vllm_refuses(fake["lacks"], target, "medusa") is None
    report = {"plain": {"vllm_tok_s": 1.0, "ours_tok_s": 1.0, "vllm_vs_ours": {"equal": 1, "of": 1}},
              "runs": {"x-vllm-eagle3": {"refused": why}}}
    assert "not run: vLLM 0.32.0's Gemma3ForCausalLM" in table(report)
