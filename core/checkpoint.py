"""The checkpoint format: safetensors + JSON, never pickle.

A checkpoint directory holds
  * ``model.safetensors``: the drafter's trainable weights (frozen target
    weights such as a shared LM head are not duplicated);
  * ``config.json``: the drafter config (its ``kind`` included);
  * ``manifest.json``: kind, target name, fingerprint and dtype (the dtype
    the target computed the drafter's training features in), recipe, data
    provenance, metrics, the exact command, versions, time.
Loading against a target with another fingerprint raises
``TargetMismatchError``; a missing, truncated or malformed file raises
``CheckpointError`` naming the file and what is wrong with it. Decoding with
a target loaded in another dtype than the manifest's works (the fingerprint
does not depend on the dtype) with a `DtypeMismatchWarning`: the drafter saw
features of another rounding, so its acceptance may differ (never the output
distribution).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith import __version__, registry
from draftsmith.machine import git_commit, machine
from draftsmith.target import Target, check_fingerprint, dtype_name

MANIFEST = "manifest.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"


class DtypeMismatchWarning(UserWarning):
    """A drafter trained on features of the target in one dtype decodes with the target in another."""


class CheckpointError(ValueError):
    """A checkpoint or export file is missing, truncated or malformed (the message names the file)."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file a checkpoint or export needs is not there."""


def read_json(path: str | Path, what: str = "file", required: tuple[str, ...] = ()) -> dict:
    """A JSON object from ``path``, or a `CheckpointError` naming the file and the problem.

    ``required`` lists top-level keys that must be present (dotted for nested ones).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: missing ({what})")
    try:
        obj = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a text file ({what}); the file is corrupt") from None
    except json.JSONDecodeError as e:
        hint = " (empty file)" if not path.read_bytes().strip() else ""
        raise CheckpointError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}{hint} "
                              f"({what})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(obj).__name__} ({what})")
    for key in required:
        node: Any = obj
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise CheckpointError(f"{path}: no {key!r} field ({what})")
            node = node[part]
    return obj


def check_safetensors(path: str | Path, what: str = "weights") -> dict[str, dict]:
    """Check that ``path`` is a complete safetensors file; returns its tensor index (name -> dtype, shape).

    Reads only the header and the file size, so a truncated copy is named as such
    (with the bytes expected and found) instead of failing inside the loader.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: missing ({what})")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated or empty ({size} bytes; a safetensors file starts with an 8-byte "
                              f"header length) ({what})")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated or not a safetensors file (header of {n} bytes announced, "
                                  f"{size - 8} bytes in the file) ({what})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise CheckpointError(f"{path}: corrupt safetensors header ({what})") from None
    have = size - 8 - n
    if have < end:
        raise CheckpointError(f"{path}: truncated: the header describes {end} bytes of tensor data, the file holds "
                              f"{have} ({what}); copy or save it again")
    return tensors


def read_safetensors(path: str | Path, what: str = "weights", device: str = "cpu") -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` with a `CheckpointError` naming the file when it is truncated or corrupt."""
    check_safetensors(path, what)
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as safetensors: {e} ({what})") from None


def command_line() -> str:
    """The exact command that is running, for manifests."""
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """Versions, machine facts (CPU model and instruction sets, memory) and the code's commit, recorded next to
    every result."""
    import transformers
    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "draftsmith": __version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "machine": machine(), "code": git_commit(),
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
                    metrics: dict | None = None, extra: dict | None = None,
                    target_dtype: str | None = None) -> Path:
    """Write a drafter checkpoint directory (atomic per file).

    ``target_dtype``: the dtype the target computed the training features in (a cache's ``target_dtype``),
    default ``target``'s own; recorded as the manifest's ``target.dtype``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = trainable_state_dict(module)
    tmp = path / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp), metadata={"format": "pt", "kind": module.kind,
                                      "target_fingerprint": target.fingerprint})
    os.replace(tmp, path / WEIGHTS)
    if callable(getattr(module, "save_extra", None)):  # files a kind keeps beside its weights (a tokenizer)
        module.save_extra(path)
    _atomic_write_json(path / CONFIG, config_json(module))
    manifest = {
        "kind": module.kind,
        "target": {"name": target.name, "path": str(target.path), "fingerprint": target.fingerprint,
                   "dtype": target_dtype or dtype_name(target.dtype)},
        "recipe": recipe, "data": data, "metrics": metrics or {},
        "command": command_line(), "environment": environment(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "parameters": sum(v.numel() for v in sd.values()),
    }
    if extra:
        manifest.update(extra)
    _atomic_write_json(path / MANIFEST, manifest)
    return path


def config_json(module) -> dict:
    """A drafter module's config.json: its pydantic config dumped (the kind's recipe fields and the target's
    shapes), or its dict, with its ``kind``."""
    c = module.config
    c = c.model_dump(mode="json") if hasattr(c, "model_dump") else dict(c)
    return {"kind": module.kind, **{k: v for k, v in c.items() if k != "kind"}}


def config_value(module, key: str, default=None):
    """One field of a drafter module's config (its kind's pydantic config, or a dict), or ``default``."""
    c = getattr(module, "config", None)
    if c is None:
        return default
    return c.get(key, default) if isinstance(c, dict) else getattr(c, key, default)


def read_manifest(path: str | Path) -> dict:
    """A checkpoint's manifest; `CheckpointError` (a ValueError) naming the file when missing or malformed."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"{path}: no such checkpoint directory")
    if not (path / MANIFEST).exists():
        raise MissingFileError(f"{path} is not a draftsmith checkpoint (no {MANIFEST})")
    return read_json(path / MANIFEST, "checkpoint manifest", required=("kind", "target.fingerprint"))


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
    config = read_json(path / CONFIG, "drafter config", required=("kind",))
    kind = config.pop("kind")
    try:
        cls = registry.get(kind)
    except KeyError as e:
        raise CheckpointError(f"{path / CONFIG}: {e.args[0]}") from None
    try:
        build = getattr(cls, "from_config_dir", None)  # a kind with files beside its weights (its own tokenizer)
        module = build(config, target, path) if build is not None else cls.from_config(config, target)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path / CONFIG}: does not describe a {kind!r} drafter for this target: {e}") from None
    sd = read_safetensors(path / WEIGHTS, f"{kind} weights")
    try:
        missing, unexpected = module.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # shape mismatches raise even with strict=False
        raise CheckpointError(f"{path / WEIGHTS}: tensors do not fit {path / CONFIG}: "
                              f"{str(e).splitlines()[-1].strip()}") from None
    shared = set(getattr(module, "shared_with_target", ()))
    missing = [k for k in missing if not any(k == s or k.startswith(s + ".") for s in shared)]
    if missing or unexpected:
        raise CheckpointError(f"{path / WEIGHTS} does not match kind {kind!r}: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return module.to(device).eval(), manifest


def check_dtype(manifest: dict, target: Target, what: str = "checkpoint") -> bool:
    """Warn (`DtypeMismatchWarning`) when the target decodes in another dtype than the one the checkpoint's
    features were computed in (a manifest without ``target.dtype`` predates the field: float32). True if equal."""
    trained = (manifest.get("target") or {}).get("dtype") or "float32"
    now = dtype_name(target.dtype)
    if trained == now:
        return True
    warnings.warn(f"{what} was trained on features of the target in {trained}; the target now runs in {now}: "
                  f"decoding stays lossless (w.r.t. the target in {now}) but acceptance may differ",
                  DtypeMismatchWarning, stacklevel=3)
    return False


def resolve_drafter(spec: str | Path, target: Target):
    """The decoder drafter a spec names, the one way every command reads one: a checkpoint directory, or a
    decoder-only drafter made without one (``first-layers:N``, ``early-exit:L``, ``suffix``, ``prompt-lookup:K``;
    `registry.untrained_drafters` lists them). A directory of that name wins over the spec."""
    if not Path(spec).is_dir():
        d = registry.untrained_drafter(str(spec), target)
        if d is not None:
            return d
    return drafter_from_checkpoint(spec, target)


def drafter_from_checkpoint(path: str | Path, target: Target):
    """Load a trained drafter checkpoint (fingerprint-checked) as a decoder drafter: the kind's own adapter,
    its modules cast to the target's dtype (and a warning when it was trained in another, `check_dtype`)."""
    p = next(target.model.parameters())
    module, manifest = load_checkpoint(path, target, device=p.device)
    check_dtype(manifest, target, what=f"checkpoint {path}")
    kind = manifest.get("kind", "drafter")
    return module.to(dtype=p.dtype).decoder_drafter(target, manifest["target"]["fingerprint"], kind)


def read_export_config(src: str | Path, target: Target, what: str) -> tuple[Path, Path, dict]:
    """(directory, its config.json path, the config) of a drafter directory in a serving engine's layout;
    one that draftsmith exported also has its target fingerprint checked against ``target``."""
    src = Path(src)
    if not src.is_dir():
        raise MissingFileError(f"{src}: no such directory")
    cfg_path = src / CONFIG
    config = read_json(cfg_path, f"{what} config")
    fp = config.get("draftsmith_target_fingerprint")
    if fp:
        check_fingerprint(fp, target, what=f"{what} export {src}")
    return src, cfg_path, config

