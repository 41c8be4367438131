"""Medusa heads in the layouts serving engines load, and back.

One export directory serves both engines (names read from their loaders):

  * vLLM (``vllm/model_executor/models/medusa.py``): ``config.json`` with
    ``model_type: "medusa"``, ``num_heads`` / ``num_hidden_layers`` (and the
    ``medusa_*`` spellings it renames), ``hidden_size``, ``vocab_size``,
    ``medusa_fc_bias``; ``model.safetensors`` with
    ``blocks.{i}.layers.{j}.weight [d, d]`` (+ ``.bias``) and
    ``lm_heads.{i}.weight [V, d]``. Head block: ``x + SiLU(W x + b)``, ours too,
    and ours always has the bias, so ``medusa_fc_bias: true``.
  * TGI and the original Medusa repository: the same ``config.json``
    (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``
    and no ``architectures`` key: TGI treats a config with one as another
    speculator) and ``medusa_lm_head.safetensors`` with
    ``{i}.{j}.linear.weight`` / ``.bias`` and ``{i}.{n}.weight`` (n = layers).

Engines read the files they know and skip unknown tensor names, so vLLM
ignores the TGI file's names and TGI never opens ``model.safetensors``.
Heads that share the target's LM head get explicit per-head copies of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.checkpoint import (CheckpointError, MissingFileError, check_safetensors, read_export_config,
                                   read_safetensors)
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.registry import ExportFormat, register_format
from draftsmith.target import Target

VLLM_WEIGHTS = "model.safetensors"
TGI_WEIGHTS = "medusa_lm_head.safetensors"
CONFIG = "config.json"


def _head_projection(heads: MedusaHeads, i: int) -> torch.Tensor:
    """Head i's d -> V projection weight: its own, or the target's shared LM head."""
    lin = heads.proj[i] if heads.proj is not None else heads.lm_head
    if getattr(lin, "bias", None) is not None:
        raise ValueError("a Medusa head whose projection has a bias cannot be exported: vLLM's lm_heads and "
                         "TGI's output layer have none")
    return lin.weight


def engine_tensors(heads: MedusaHeads) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(vLLM state dict, TGI / original-Medusa state dict) of ``heads``, each tensor its own contiguous copy."""
    n = heads.config.num_layers
    vllm: dict[str, torch.Tensor] = {}
    tgi: dict[str, torch.Tensor] = {}

    def own(t: torch.Tensor) -> torch.Tensor:  # safetensors refuses tensors that share memory
        return t.detach().to("cpu").clone().contiguous()

    for i, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            vllm[f"blocks.{i}.layers.{j}.weight"] = own(res.linear.weight)
            vllm[f"blocks.{i}.layers.{j}.bias"] = own(res.linear.bias)
            tgi[f"{i}.{j}.linear.weight"] = own(res.linear.weight)
            tgi[f"{i}.{j}.linear.bias"] = own(res.linear.bias)
        w = _head_projection(heads, i)
        vllm[f"lm_heads.{i}.weight"] = own(w)
        tgi[f"{i}.{n}.weight"] = own(w)
    return vllm, tgi


def engine_config(heads: MedusaHeads, base_model: str, provenance: dict) -> dict:
    """The one ``config.json`` vLLM and TGI both read (``provenance``: extra top-level keys)."""
    c = heads.config.model_dump()
    bad = [k for k in provenance if "num" in k and ("heads" in k or "layers" in k)]
    if bad:  # vLLM renames every key holding "num" and "heads"/"layers": it would clobber num_heads
        raise ValueError(f"provenance keys {bad} would be renamed by vLLM's MedusaConfig")
    return {
        "model_type": "medusa",
        "num_heads": int(c["num_heads"]), "num_hidden_layers": int(c["num_layers"]),
        "medusa_num_heads": int(c["num_heads"]), "medusa_num_layers": int(c["num_layers"]),
        "hidden_size": int(c["hidden_size"]), "vocab_size": int(c["vocab_size"]),
        "medusa_fc_bias": True,  # ours is x + SiLU(W x + b): the bias is always there
        "base_model_name_or_path": base_model,
        **provenance,
    }


def write_medusa_dir(heads: MedusaHeads, out: Path, base_model: str, provenance: dict) -> list[str]:
    """Write config.json, model.safetensors (vLLM) and medusa_lm_head.safetensors (TGI) into ``out``."""
    vllm, tgi = engine_tensors(heads)
    meta = {"format": "pt"}
    save_file(vllm, str(out / VLLM_WEIGHTS), metadata=meta)
    save_file(tgi, str(out / TGI_WEIGHTS), metadata=meta)
    (out / CONFIG).write_text(json.dumps(engine_config(heads, base_model, provenance), indent=2, default=str))
    return [CONFIG, VLLM_WEIGHTS, TGI_WEIGHTS]


def _int_field(config: dict, path: Path, *names: str) -> int:
    for n in names:
        if n in config:
            try:
                return int(config[n])
            except (TypeError, ValueError):
                raise CheckpointError(f"{path}: {n!r} is {config[n]!r}, not an integer") from None
    raise CheckpointError(f"{path}: none of {list(names)} (a Medusa config names its number of heads and layers)")


def read_medusa_dir(src: str | Path, target: Target) -> tuple[MedusaHeads, dict]:
    """Medusa heads for ``target`` from a vLLM-Medusa or original-Medusa / TGI directory; returns (heads, config).

    The vLLM names are read when ``model.safetensors`` holds them, else the
    original names from ``medusa_lm_head.safetensors``. When every head's
    projection equals the target's LM head exactly, the heads share it (as
    our checkpoints do); otherwise they keep their own projections.
    A directory exported by draftsmith also has its target fingerprint checked.
    """
    src, cfg_path, config = read_export_config(src, target, "Medusa")
    if float(config.get("logit_scale", 1.0)) != 1.0:
        raise CheckpointError(f"{cfg_path}: logit_scale {config['logit_scale']} is not supported (our heads have none)")
    K = _int_field(config, cfg_path, "medusa_num_heads", "num_heads")
    n = _int_field(config, cfg_path, "medusa_num_layers", "num_hidden_layers")
    d, V = target.hidden_size, target.vocab_size
    for key, want in (("hidden_size", d), ("vocab_size", V), ("truncated_vocab_size", V)):
        if key in config and int(config[key]) != want:
            raise CheckpointError(f"{cfg_path}: {key} is {config[key]}, the target {target.name!r} has {want}")
    if (src / VLLM_WEIGHTS).exists() and "lm_heads.0.weight" in check_safetensors(src / VLLM_WEIGHTS):
        file, sd = src / VLLM_WEIGHTS, read_safetensors(src / VLLM_WEIGHTS, "vLLM Medusa weights")

        def names(i: int, j: int) -> tuple[str, str, str]:
            return f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias", f"lm_heads.{i}.weight"
        with_bias = bool(config.get("medusa_fc_bias", False))  # vLLM's default: no bias
    elif (src / TGI_WEIGHTS).exists():
        file, sd = src / TGI_WEIGHTS, read_safetensors(src / TGI_WEIGHTS, "Medusa weights")

        def names(i: int, j: int) -> tuple[str, str, str]:
            return f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias", f"{i}.{n}.weight"
        with_bias = True  # TGI and the original ResBlock load the bias unconditionally
    elif (src / "medusa_lm_head.pt").exists() or (src / "pytorch_model.bin").exists():
        raise CheckpointError(f"{src}: only pickle weights (.pt/.bin) there; draftsmith never loads pickle: convert "
                              f"them to {TGI_WEIGHTS} first")
    else:
        raise MissingFileError(f"{src}: neither {VLLM_WEIGHTS} (vLLM names) nor {TGI_WEIGHTS} (TGI / Medusa names)")

    def get(name: str, shape: tuple[int, ...], optional: bool = False) -> torch.Tensor | None:
        t = sd.get(name)
        if t is None:
            if optional:
                return None
            raise CheckpointError(f"{file}: no tensor {name!r} ({K} heads x {n} layers in {cfg_path})")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{file}: {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t.to(torch.float32)

    projs = [get(names(i, 0)[2], (V, d)) for i in range(K)]
    lm_w = target.lm_head.weight.detach().to("cpu", torch.float32)
    share = getattr(target.lm_head, "bias", None) is None and all(torch.equal(p, lm_w) for p in projs)
    heads = MedusaHeads.for_target(target, num_heads=K, num_layers=n, share_lm_head=share)
    with torch.no_grad():
        for i in range(K):
            for j in range(n):
                wn, bn, _ = names(i, j)
                lin = heads.blocks[i][j].linear
                lin.weight.copy_(get(wn, (d, d)))
                b = get(bn, (d,)) if with_bias else None
                lin.bias.copy_(b if b is not None else torch.zeros(d))  # no bias == a zero bias
            if not share:
                heads.proj[i].weight.copy_(projs[i])
    return heads.to(target.lm_head.weight.device).eval(), config


def _write(src, out: Path, target: Target, base_model: str, prov: dict) -> list[str]:
    return write_medusa_dir(src.module, out, base_model, prov)


@torch.no_grad()
def _check(src, out: Path, target: Target) -> tuple[torch.Tensor, torch.Tensor, bool]:
    heads, _ = read_medusa_dir(out, target)
    w = target.lm_head.weight
    h = torch.randn(3, target.hidden_size, device=w.device, dtype=w.dtype)
    # a trainable projection equal to the target's head is reloaded as the shared head: same weights,
    # another (batched) product, so compare to float precision rather than bit for bit
    return src.module(h), heads(h), False


def _recognizes(config: dict) -> bool:
    return config.get("model_type") == "medusa" or "medusa_num_heads" in config


def _read(path: Path, target: Target) -> tuple[MedusaHeads, dict, dict]:
    heads, config = read_medusa_dir(path, target)
    fmt = "vllm-medusa" if config.get("model_type") == "medusa" else "medusa"
    return heads, config, {"path": str(path), "format": fmt,
                           "base_model_name_or_path": config.get("base_model_name_or_path"),
                           "shares_target_lm_head": heads.proj is None}


# Medusa heads over a pruned draft vocabulary (vocab_keep) need vLLM's truncated head + token map, not
# written yet: they go to the draftsmith format rather than silently widening to the full vocabulary.
VLLM_MEDUSA = register_format(ExportFormat(
    name="vllm-medusa",
    holds=lambda s: isinstance(s.module, MedusaHeads) and s.module.draft_head is None,
    what="Medusa heads over the full vocabulary",
    write=_write,
    usage="vLLM: `speculative_config={\"method\": \"medusa\", \"model\": \"<this dir>\", "
          "\"num_speculative_tokens\": K}`; TGI: `--model-id <this dir>` (reads medusa_lm_head.safetensors, "
          "loads the base model from base_model_name_or_path); draftsmith: `draftsmith import <this dir> --out CKPT`",
    check=_check,
    note="`model.safetensors` holds vLLM's names, `medusa_lm_head.safetensors` the TGI / original "
         "Medusa names (the same weights). Heads that share the target's LM head carry explicit copies "
         "of it. TGI's fused path (MedusaHeadV2) needs `medusa_num_layers == 1` and projects with the "
         "base model's own LM head.",
    recognizes=_recognizes,
    read=_read,
))
