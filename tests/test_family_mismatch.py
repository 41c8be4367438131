"""Mismatches per model family, each a clear error rather than a drafter that loads and drafts badly: a drafter
trained for one family's target loaded against another's (as a checkpoint and from every export format its kind
has), a config field missing, a layer trait dropped, and a wrong EAGLE-3 aux-layer id."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith import registry
from draftsmith.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from draftsmith.export import export, formats_for, load_drafter, load_source
from tests.families import FAMILIES, family_target
from tests.test_families import KINDS, REFUSED

PAIRS = [(f, FAMILIES[(i + 1) % len(FAMILIES)]) for i, f in enumerate(FAMILIES)]  # each family, and another


@pytest.fixture(scope="module")
def targets():
    return {f: family_target(f) for f in FAMILIES}


def _module(tgt, family: str, name: str):
    kind, fields = KINDS[name]
    torch.manual_seed(0)
    return registry.get(kind).for_target(tgt, **fields).eval()


@pytest.mark.parametrize("family,other", PAIRS)
def test_a_drafter_for_one_family_is_refused_by_another_as_checkpoint_and_export(targets, family, other, tmp_path):
    """Every kind the family builds, saved for its target, is refused by the other family's target by
    fingerprint; so is each export format the kind has, read back against the other target. Mistral with and
    without its window have the same weights: the fingerprint tells them apart by their windows."""
    tgt, wrong = targets[family], targets[other]
    for name in ("medusa", "hydra++", "eagle3"):
        if (family, name) in REFUSED:
            continue
        ckpt = tmp_path / f"{name}-ckpt"
        save_checkpoint(ckpt, _module(tgt, family, name), tgt)
        with pytest.raises(ValueError, match="fingerprint"):
            load_checkpoint(ckpt, wrong)
        for fmt in formats_for(load_source(ckpt, tgt)):
            out = export(ckpt, fmt, tmp_path / f"{name}-{fmt}", tgt)
            with pytest.raises(ValueError, match="fingerprint"):
                load_drafter(out, wrong)


def _edit_config(ckpt, edit) -> None:
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_missing_config_field_or_a_dropped_trait_is_named(targets, family, tmp_path):
    """A config.json without a field it needs names the field; one whose layer traits were dropped (a Hydra++
    prefix layer of Qwen2, Qwen3 or Gemma 3 read as Llama's) names the weights that do not fit, rather than
    loading a layer that computes another function."""
    tgt = targets[family]
    ckpt = tmp_path / "medusa"
    save_checkpoint(ckpt, _module(tgt, family, "medusa"), tgt)
    _edit_config(ckpt, lambda c: c.pop("hidden_size"))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_checkpoint(ckpt, tgt)
    if (family, "hydra++") in REFUSED:
        return
    ckpt = tmp_path / "hydra-pp"
    m = _module(tgt, family, "hydra++")
    save_checkpoint(ckpt, m, tgt)
    traits = {k: v for k, v in m.config.prefix.model_dump().items() if k in ("qkv_bias", "qk_norm", "sandwich_norms")
              and v}
    if not traits:
        return
    _edit_config(ckpt, lambda c: [c["prefix"].pop(k) for k in traits])
    with pytest.raises(CheckpointError, match="does not match kind 'hydra'"):
        load_checkpoint(ckpt, tgt)


def test_a_wrong_aux_layer_id_is_named(targets, tmp_path):
    tgt = targets["gemma3"]
    ckpt = tmp_path / "eagle3"
    save_checkpoint(ckpt, _module(tgt, "gemma3", "eagle3"), tgt)
    _edit_config(ckpt, lambda c: c.update(aux_layers=[1, 2, 9]))
    with pytest.raises(CheckpointError, match=r"aux_layers \[1, 2, 9\] do not fit a target with 4 layers"):
        load_checkpoint(ckpt, tgt)
