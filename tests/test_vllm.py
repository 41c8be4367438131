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
