"""One short training run of every kind a family takes, on each family's tiny target: the recipe's drafter section
filled for the target (EAGLE-3's aux layers from its layer count), the cache of the states the kind needs, two
optimizer steps, and a checkpoint that loads for the target with finite weights."""

from __future__ import annotations

import pytest
import torch

from draftsmith import registry
from draftsmith.checkpoint import load_checkpoint
from draftsmith.pipeline.stages import for_target
from draftsmith.recipe import parse_recipe
from draftsmith.train.data.cache import build_cache
from draftsmith.train.training.trainer import train
from tests.families import FAMILIES, VOCAB, WINDOW, family_target
from tests.test_families import KINDS, REFUSED

TRAINED = ("medusa", "hydra++", "eagle3", "dflash", "kangaroo", "standalone")


def _sequences(n: int = 8, length: int = WINDOW, seed: int = 0) -> list[dict]:
    """Random rows within the tiny Gemma 3's window (the data engine's rows stay within a target's window)."""
    g = torch.Generator().manual_seed(seed)
    return [{"ids": torch.randint(3, VOCAB, (length,), generator=g).tolist(), "mask": [0] * 2 + [1] * (length - 2)}
            for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_trains_on_each_family(family, tmp_path):
    tgt = family_target(family)
    seqs = _sequences()
    for name in TRAINED:
        if (family, name) in REFUSED:
            continue
        kind, fields = KINDS[name]
        # EAGLE-3's and DFlash's layers: derived from the target
        fields = {k: v for k, v in fields.items() if k not in ("aux_layers", "target_layers")}
        recipe = parse_recipe({"name": name, "output_dir": str(tmp_path / name), "seed": 0,
                               "drafter": {"kind": kind, **fields},
                               "train": {"max_steps": 2, "batch_size": 4, "chunk_len": WINDOW, "lr": 1e-3,
                                         "warmup_steps": 1, "tracker": "none", "save_every": 2, "log_every": 1,
                                         "calibration_every": 0}})
        for_target(recipe, tgt)
        needs = registry.get(kind).cache_needs(recipe.drafter.model_dump())
        build_cache(tgt, seqs, needs, tmp_path / name / "cache", dtype="float32")
        ckpt, timing = train(recipe, tgt, tmp_path / name / "cache", recipe.out)
        assert timing["steps"] == 2, (family, name)
        module, _ = load_checkpoint(ckpt, tgt)
        assert all(torch.isfinite(p).all() for p in module.parameters()), (family, name)
