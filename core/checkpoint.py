"""The checkpoint format: safetensors + JSON, never pickle.

A checkpoint directory holds
  * ``model.safetensors``: the drafter's trainable weights (frozen target
    weights such as a shared LM head are not duplicated);
  * ``config.json``: the drafter config (its ``kind`` included);
  * ``manifest.json``: kind, target name and fingerprint, recipe, data
    provenance, metrics, the exact command, versions, time.
Loading against a target with another fingerprint raises
``TargetMismatchError``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith import __version__, registry
from draftsmith.target import Target, check_fingerprint

MANIFEST = "manifest.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def command_line() -> str:
    """The exact command that is running, for manifests."""
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded next to every result."""
    import transformers
    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "draftsmith": __version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return env


def _atomic_write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str))
    os.replace(tmp, path)


def trainable_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: everything except frozen buffers shared with the target."""
    skip = set(getattr(module, "shared_with_target", ()))
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()
            if not any(k == s or k.startswith(s + ".") for s in skip)}


def save_checkpoint(path: str | Path, module: torch.nn.Module, target: Target, *,
                    recipe: dict | None = None, data: dict | None = None,
                    metrics: dict | None = None, extra: dict | None = None) -> Path:
    """Write a drafter checkpoint directory (atomic per file)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = trainable_state_dict(module)
    tmp = path / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp), metadata={"format": "pt", "kind": module.kind,
                                      "target_fingerprint": target.fingerprint})
    os.replace(tmp, path / WEIGHTS)
    _atomic_write_json(path / CONFIG, {"kind": module.kind, **module.config})
    manifest = {
        "kind": module.kind,
        "target": {"name": target.name, "path": str(target.path), "fingerprint": target.fingerprint},
        "recipe": recipe, "data": data, "metrics": metrics or {},
        "command": command_line(), "environment": environment(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "parameters": sum(v.numel() for v in sd.values()),
    }
    if extra:
        manifest.update(extra)
    _atomic_write_json(path / MANIFEST, manifest)
    return path


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(f"{path} is not a draftsmith checkpoint (no {MANIFEST})")
    return json.loads((path / MANIFEST).read_text())


def update_metrics(path: str | Path, metrics: dict) -> None:
    """Merge new metrics into a checkpoint's manifest."""
    path = Path(path)
    m = read_manifest(path)
    m.setdefault("metrics", {}).update(metrics)
    _atomic_write_json(path / MANIFEST, m)


def load_checkpoint(path: str | Path, target: Target, device: str | torch.device = "cpu"):
    """Load a drafter for ``target``; fails clearly if it belongs to another."""
    path = Path(path)
    manifest = read_manifest(path)
    check_fingerprint(manifest["target"]["fingerprint"], target, what=f"checkpoint {path}")
    config = json.loads((path / CONFIG).read_text())
    kind = config.pop("kind")
    cls = registry.get(kind)
    module = cls.from_config(config, target)
    sd = load_file(str(path / WEIGHTS))
    missing, unexpected = module.load_state_dict(sd, strict=False)
    shared = set(getattr(module, "shared_with_target", ()))
    missing = [k for k in missing if not any(k == s or k.startswith(s + ".") for s in shared)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match kind {kind!r}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return module.to(device).eval(), manifest
