"""Trainer state for exact resume, stored without pickle.

Optimizer state tensors go to safetensors, scalars and param groups to JSON,
RNG states as uint8 tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_trainer_state(path: Path, optimizer: torch.optim.Optimizer, scheduler, step: int, extra: dict) -> None:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"opt.{pid}.{name}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = v
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    save_file(tensors, str(path / "trainer_state.safetensors.tmp"))
    os.replace(path / "trainer_state.safetensors.tmp", path / "trainer_state.safetensors")
    meta = {"step": step, "param_groups": sd["param_groups"], "scalars": scalars,
            "scheduler": scheduler.state_dict() if scheduler is not None else None, **extra}
    meta["scheduler"] = {k: v for k, v in (meta["scheduler"] or {}).items() if k != "lr_lambdas"}
    (path / "trainer_state.json.tmp").write_text(json.dumps(meta, indent=1, default=str))
    os.replace(path / "trainer_state.json.tmp", path / "trainer_state.json")


def load_trainer_state(path: Path, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    meta = json.loads((path / "trainer_state.json").read_text())
    tensors = load_file(str(path / "trainer_state.safetensors"))
    state: dict = {}
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    for key, v in meta["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    if scheduler is not None and meta.get("scheduler"):
        sd = scheduler.state_dict()
        sd.update(meta["scheduler"])
        scheduler.load_state_dict(sd)
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return meta


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete periodic checkpoint under run_dir/checkpoints."""
    root = run_dir / "checkpoints"
    if not root.exists():
        return None
    done = [p for p in root.glob("step-*") if (p / "trainer_state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)
