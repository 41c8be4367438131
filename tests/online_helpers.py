"""Shared builders for the server and online-job tests (tiny target, tiny Medusa checkpoints, log lines)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.checkpoint import save_checkpoint
from draftsmith.recipe import parse_recipe
from draftsmith.train.training.trainer import build_drafter


def online_recipe(tmp_path: Path, **online):
    o = {"every_records": 8, "holdout_every": 4, "holdout_window": 4, "eval_max_new_tokens": 8, "lr": 1e-2,
         "batch_size": 4, "max_steps": 3, "max_record_tokens": 400, "poll_seconds": 0.01, **online}
    return parse_recipe({"name": "on", "output_dir": str(tmp_path / "run"), "seed": 1,
                         "drafter": {"kind": "medusa", "num_heads": 2, "num_layers": 1},
                         "cache": {"dtype": "float32"},
                         "train": {"chunk_len": 16, "tracker": "none"}, "online": o})


def medusa_checkpoint(target, path: Path, seed: int = 0, tmp_path: Path | None = None) -> Path:
    """A randomly initialised tiny Medusa checkpoint (different seeds give different drafters)."""
    import torch
    torch.manual_seed(seed)
    r = online_recipe(tmp_path or path.parent)
    module = build_drafter(r, target)
    for p in module.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.5)
    return save_checkpoint(path, module, target, recipe=r.model_dump(mode="json"))
