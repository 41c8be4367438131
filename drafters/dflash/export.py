"""DFlash drafters in the layout serving engines load, and back.

``vllm-dflash``: z-lab's Hugging Face layout (``architectures: ["DFlashDraftModel"]``), which vLLM serves as method
``dflash`` and llama.cpp's converter (``convert_hf_to_gguf.py --target-model-dir``) turns into a GGUF for its
``draft-dflash`` type. config.json is a Qwen3 config of the drafter's layers (the target's layer shape,
``num_hidden_layers`` = the drafter's layers) plus ``block_size``, ``num_target_layers`` and ``dflash_config``
(``mask_token_id``, ``target_layer_ids`` in z-lab's convention: our Hugging Face ``hidden_states`` indices minus
one, which vLLM and llama.cpp add back) and ``eagle_aux_hidden_state_layer_ids`` (ours, vLLM's convention, which
vLLM reads first). Weights: ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.*`` under
Qwen3's names; with a pruned draft vocabulary also ``lm_head.weight`` (draft vocabulary x H), ``d2t`` and ``t2d``
as EAGLE-3's (vLLM maps them; llama.cpp's converter drops them, so such a drafter is refused for llama.cpp by name);
no ``embed_tokens`` (engines share the target's). Reading it back (``draftsmith import``) checks the target's
shape, the layer ids and the vocabulary maps, with errors that name the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.checkpoint import (CheckpointError, MissingFileError, check_safetensors, read_export_config,
                                   read_safetensors)
from draftsmith.common.layers import rope_parameters
from draftsmith.common.vocab import copy_tensors, kept_from_maps, vocab_maps
from draftsmith.drafters.dflash.model import DFlashModule, check_target_layers
from draftsmith.registry import ExportFormat, register_format
from draftsmith.target import Target

CONFIG, WEIGHTS = "config.json", "model.safetensors"
FORMAT = "vllm-dflash"
#: our parameter names in layer i -> Qwen3's (after ``layers.{i}.``)
LAYER_NAMES = {
    "q.weight": "self_attn.q_proj.weight", "k.weight": "self_attn.k_proj.weight",
    "v.weight": "self_attn.v_proj.weight", "o.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight",
    "gate.weight": "mlp.gate_proj.weight", "up.weight": "mlp.up_proj.weight", "down.weight": "mlp.down_proj.weight",
    "input_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = ("fc.weight", "hidden_norm.weight", "norm.weight")


def name_map(m: DFlashModule) -> dict[str, str]:
    """Our state-dict names -> the layout's, for the drafter's own tensors (not the head)."""
    out = {k: k for k in TOP_NAMES}
    for i in range(len(m.layers)):
        out.update({f"layers.{i}.{ours}": f"layers.{i}.{theirs}" for ours, theirs in LAYER_NAMES.items()})
    return out


def engine_tensors(m: DFlashModule) -> dict[str, torch.Tensor]:
    sd = m.state_dict()
    out = {theirs: sd[ours] for ours, theirs in name_map(m).items()}
    if m.draft_head is not None:
        out["lm_head.weight"] = m.draft_head.weight
        out.update(vocab_maps(m.draft_head.kept_ids, m.config.vocab_size))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def engine_config(m: DFlashModule, target: Target, base_model: str, provenance: dict) -> dict:
    c, tc = m.config, target.config
    ids = [int(i) for i in c.target_layers]
    n_draft = len(m.draft_head.kept_ids) if m.draft_head is not None else c.vocab_size
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": c.draft_layers,
        "rms_norm_eps": c.eps, "vocab_size": c.vocab_size, "draft_vocab_size": n_draft, **rope_parameters(tc),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 8192)), "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
        "block_size": c.block_size, "num_target_layers": c.num_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in ids],
                          "block_size": c.block_size, "causal": False},
        "eagle_aux_hidden_state_layer_ids": ids, "target_hidden_size": c.hidden_size,
        "draftsmith_draft_len": c.draft_len, "base_model_name_or_path": base_model, **provenance}


def _write(src, out: Path, target: Target, base_model: str, prov: dict) -> list[str]:
    save_file(engine_tensors(src.module), str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(engine_config(src.module, target, base_model, prov), indent=2, default=str))
    return [CONFIG, WEIGHTS]


def read_dflash_dir(src: str | Path, target: Target) -> tuple[DFlashModule, dict]:
    """A DFlash drafter for ``target`` from a directory in z-lab's layout; returns (module, config)."""
    src, cfg_path, config = read_export_config(src, target, "DFlash")
    dc = config.get("dflash_config") or {}
    L = int(target.config.num_hidden_layers)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if dc.get("target_layer_ids") is None:
            raise CheckpointError(f"{cfg_path}: no dflash_config.target_layer_ids (nor "
                                  "eagle_aux_hidden_state_layer_ids)")
        ids = [int(i) + 1 for i in dc["target_layer_ids"]]  # z-lab's ids: the outputs of 0-based layers
    try:
        check_target_layers([int(i) for i in ids], L)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: target layer ids: {e}") from None
    mask = dc.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise CheckpointError(f"{cfg_path}: no dflash_config.mask_token_id")
    block = int(dc.get("block_size", config.get("block_size", 16)))
    if dc.get("causal") or config.get("is_causal"):
        raise CheckpointError(f"{cfg_path}: causal draft attention is not DFlash's block (draftsmith drafts "
                              "non-causally)")
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in config and int(config[key]) != want:
            raise CheckpointError(f"{cfg_path}: {key} is {config[key]}, the target {target.name!r} needs {want}")
    if not (src / WEIGHTS).exists():
        raise MissingFileError(f"{src}: no {WEIGHTS}")
    check_safetensors(src / WEIGHTS, "DFlash weights")
    sd = read_safetensors(src / WEIGHTS, "DFlash weights")
    V = target.vocab_size
    n_draft = int(config.get("draft_vocab_size") or V)
    kept = kept_from_maps(sd, n_draft, V, src / WEIGHTS)
    full = n_draft == V and bool(torch.equal(kept, torch.arange(V)))
    m = DFlashModule.for_target(target, target_layers=[int(i) for i in ids], mask_token_id=int(mask),
                                block_size=block, draft_layers=int(config.get("num_hidden_layers", 1)),
                                vocab_keep=None if full else n_draft, draft_len=config.get("draftsmith_draft_len"))
    if not full:
        m.set_draft_vocab(kept)
    mine = name_map(m)
    if not full:
        mine["draft_head.weight"] = "lm_head.weight"
    copy_tensors(m, sd, mine, src / WEIGHTS)
    if full and "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"].float(),
                                                           target.lm_head.weight.detach().float().cpu()):
        raise CheckpointError(f"{src / WEIGHTS}: a full-vocabulary lm_head other than the target's is not supported")
    return m.eval(), config


@torch.no_grad()
def _check(src, out: Path, target: Target) -> tuple[torch.Tensor, torch.Tensor, bool]:
    back, _ = read_dflash_dir(out, target)
    a, b = src.module.eval(), back.to(next(src.module.parameters()).dtype)
    g = torch.Generator().manual_seed(0)
    n = len(a.target_layers) * a.config.hidden_size
    S = a.block_size
    feats = torch.randn(1, 9, n, generator=g).to(a.fc.weight)
    ids = torch.full((1, 2, S), a.config.mask_token_id, device=a.fc.weight.device)
    ids[0, :, 0] = torch.randint(0, a.config.vocab_size, (2,), generator=g).to(ids.device)
    anchors = torch.tensor([[3, 7]], device=ids.device)
    return a.train_forward(feats, ids, anchors), b.train_forward(feats, ids, anchors), True


def _read(path: Path, target: Target):
    m, config = read_dflash_dir(path, target)
    return m, config, {"path": str(path), "format": FORMAT, "base_model_name_or_path":
                       config.get("base_model_name_or_path")}


register_format(ExportFormat(
    name=FORMAT, holds=lambda s: isinstance(s.module, DFlashModule), what="DFlash drafters", write=_write,
    usage="vLLM: `LLM(model=<target>, speculative_config={\"method\": \"dflash\", \"model\": \"<this dir>\", "
          "\"num_speculative_tokens\": BLOCK_SIZE - 1})`; llama.cpp: `draftsmith export CKPT --to gguf` (or its "
          "converter with --target-model-dir), then `--spec-type draft-dflash`; draftsmith: `draftsmith import "
          "<this dir> --out CKPT`",
    check=_check, recognizes=lambda config: "DFlashDraftModel" in (config.get("architectures") or []), read=_read,
    note="The target's token embedding (and, over the full vocabulary, its head) is not stored: engines share the "
         "target's. dflash_config.target_layer_ids are z-lab's ids (Hugging Face hidden_states indices minus one); "
         "eagle_aux_hidden_state_layer_ids are vLLM's, the same layers."))
