"""EAGLE-3 drafters in the layouts serving engines load, and back.

Two layouts, the same tensors:
  * ``vllm-eagle3`` (the speculators format vLLM reads): config.json with ``speculators_model_type:
    "eagle3"``, ``transformer_layer_config`` (a one-layer Llama config of the target's shape),
    ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``,
    ``norm_before_residual: false`` written out (vLLM's default is true, which is another function), and
    ``speculators_config`` (a greedy proposal of ``draft_len`` tokens, the verifier); weights named
    ``layers.0.*``.
  * ``eagle3`` (the EAGLE / SpecForge / SGLang layout): a Llama config with ``architectures:
    ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``draft_vocab_size`` and
    ``eagle_config.eagle_aux_hidden_state_layer_ids``; weights named ``midlayer.*``.
Both write EAGLE 3.1's options (``norm_before_fc``, ``fc_norm``, ``norm_output``) as vLLM reads them, with
``input_norm.weight`` and ``fc_norm.{0,1,2}.weight`` where they are on. Both hold ``fc.weight`` (3H -> H),
``norm.weight``, ``lm_head.weight`` (draft vocabulary x H), ``d2t``
(int64 offsets: target id = draft id + d2t[draft id]) and ``t2d`` (bool over the target vocabulary); no
``embed_tokens`` (engines share the target's). Layer ids are Hugging Face ``hidden_states`` indices, as
vLLM counts them. Reading either back (``draftsmith import``) checks the target's shape, the layer ids and
the vocabulary maps, with errors that name the file and the field.
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
from draftsmith.drafters.eagle3.model import Eagle3Module, check_aux_layers
from draftsmith.registry import ExportFormat, register_format
from draftsmith.target import Target

CONFIG, WEIGHTS = "config.json", "model.safetensors"
#: our parameter names -> the layer's names in the engines (after the layer prefix)
LAYER_NAMES = {
    "layer.q.weight": "self_attn.q_proj.weight", "layer.k.weight": "self_attn.k_proj.weight",
    "layer.v.weight": "self_attn.v_proj.weight", "layer.o.weight": "self_attn.o_proj.weight",
    "layer.gate.weight": "mlp.gate_proj.weight", "layer.up.weight": "mlp.up_proj.weight",
    "layer.down.weight": "mlp.down_proj.weight", "layer.input_norm.weight": "input_layernorm.weight",
    "layer.hidden_norm.weight": "hidden_norm.weight", "layer.post_norm.weight": "post_attention_layernorm.weight",
}
PREFIX = {"vllm-eagle3": "layers.0.", "eagle3": "midlayer."}
#: EAGLE 3.1's options, written into both layouts' config.json under vLLM's names (all false: EAGLE-3)
EAGLE31 = ("norm_before_fc", "fc_norm", "norm_output")
#: their tensors: one norm over the concatenation, one per target state (ours and vLLM's names agree)
EAGLE31_TENSORS = ("input_norm.", "fc_norm.")


def _llama_config(m: Eagle3Module, target: Target) -> dict:
    """The one-layer Llama config of the drafter (the target's shape, its vocabulary)."""
    c, tc = m.config.model_dump(), target.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden_size"],
            "intermediate_size": c["intermediate_size"], "num_attention_heads": c["num_heads"],
            "num_key_value_heads": c["num_kv_heads"], "head_dim": c["head_dim"], "num_hidden_layers": 1,
            "rms_norm_eps": c["eps"], "vocab_size": c["vocab_size"], **rope_parameters(tc),
            "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 8192)),
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32", "bos_token_id": getattr(tc, "bos_token_id", None),
            "eos_token_id": getattr(tc, "eos_token_id", None)}


def engine_tensors(m: Eagle3Module, fmt: str) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the engines' names for ``fmt``."""
    sd = m.state_dict()
    out = {PREFIX[fmt] + eng: sd[ours] for ours, eng in LAYER_NAMES.items()}
    out["fc.weight"], out["norm.weight"] = sd["fc.weight"], sd["norm.weight"]
    out.update({k: v for k, v in sd.items() if k.startswith(EAGLE31_TENSORS)})  # vLLM's names for them
    V = m.config.vocab_size
    if m.draft_head is not None:
        kept = m.draft_head.kept_ids.long()
        out["lm_head.weight"] = m.draft_head.weight
    else:
        kept = torch.arange(V, device=m.lm_head.weight.device)
        out["lm_head.weight"] = m.lm_head.weight
    out.update(vocab_maps(kept, V))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def engine_config(m: Eagle3Module, target: Target, fmt: str, base_model: str, provenance: dict) -> dict:
    c = m.config.model_dump()
    n_draft = len(m.draft_head.kept_ids) if m.draft_head is not None else int(c["vocab_size"])
    aux = [int(i) for i in c["aux_layers"]]
    layer = _llama_config(m, target)
    if fmt == "eagle3":
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": n_draft,
                "target_hidden_size": c["hidden_size"], "norm_before_residual": False,
                **{k: bool(c[k]) for k in EAGLE31},
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
                "base_model_name_or_path": base_model, **provenance}
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "draft_vocab_size": n_draft, "target_hidden_size": c["hidden_size"], "norm_before_residual": False,
        **{k: bool(c[k]) for k in EAGLE31}, "eagle_aux_hidden_state_layer_ids": aux, "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(c["draft_len"]),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": base_model,
                         "architectures": list(getattr(target.config, "architectures", None) or
                                               ["LlamaForCausalLM"])}},
        "base_model_name_or_path": base_model, **provenance}


def _writer(fmt: str):
    def write(src, out: Path, target: Target, base_model: str, prov: dict) -> list[str]:
        save_file(engine_tensors(src.module, fmt), str(out / WEIGHTS), metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(engine_config(src.module, target, fmt, base_model, prov), indent=2,
                                             default=str))
        return [CONFIG, WEIGHTS]
    return write


def read_eagle3_dir(src: str | Path, target: Target) -> tuple[Eagle3Module, dict]:
    """An EAGLE-3 drafter for ``target`` from a directory in either layout; returns (module, config)."""
    src, cfg_path, config = read_export_config(src, target, "EAGLE-3")
    speculators = config.get("speculators_model_type") == "eagle3"
    layer = config.get("transformer_layer_config", {}) if speculators else config
    aux = config.get("eagle_aux_hidden_state_layer_ids") if speculators else \
        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = int(target.config.num_hidden_layers)
    if aux is None:  # the engines' default when a checkpoint names none
        aux = [2, L // 2, L - 3]
    try:
        check_aux_layers([int(i) for i in aux], L)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: eagle_aux_hidden_state_layer_ids: {e}") from None
    if config.get("norm_before_residual", speculators):  # vLLM's default is true
        raise CheckpointError(f"{cfg_path}: norm_before_residual is true; draftsmith's EAGLE-3 layer adds the "
                              "un-normed state (EAGLE-3's original layer): not supported")
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_hidden_layers", 1)):
        if key in layer and int(layer[key]) != want:
            raise CheckpointError(f"{cfg_path}: {key} is {layer[key]}, the target {target.name!r} needs {want}")
    if not (src / WEIGHTS).exists():
        raise MissingFileError(f"{src}: no {WEIGHTS}")
    names = check_safetensors(src / WEIGHTS, "EAGLE-3 weights")
    prefix = next((p for p in ("layers.0.", "midlayer.") if f"{p}self_attn.q_proj.weight" in names), None)
    if prefix is None:
        raise CheckpointError(f"{src / WEIGHTS}: no layer weights (layers.0.* or midlayer.*)")
    sd = read_safetensors(src / WEIGHTS, "EAGLE-3 weights")
    V = target.vocab_size
    n_draft = int(config.get("draft_vocab_size", V))
    kept = kept_from_maps(sd, n_draft, V, src / WEIGHTS)
    full = n_draft == V and bool(torch.equal(kept, torch.arange(V)))
    options = {k: bool(config.get(k, False)) for k in EAGLE31}
    m = Eagle3Module.for_target(target, aux_layers=[int(i) for i in aux], vocab_keep=None if full else n_draft,
                                **options)
    if not full:
        m.set_draft_vocab(kept)
    mine = {**{ours: prefix + eng for ours, eng in LAYER_NAMES.items()}, "fc.weight": "fc.weight",
            "norm.weight": "norm.weight", **{k: k for k in m.state_dict() if k.startswith(EAGLE31_TENSORS)}}
    if not full:
        mine["draft_head.weight"] = "lm_head.weight"
    copy_tensors(m, sd, mine, src / WEIGHTS)
    if full and "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"].float(),
                                                           target.lm_head.weight.detach().float().cpu()):
        raise CheckpointError(f"{src / WEIGHTS}: a full-vocabulary lm_head other than the target's is not supported")
    return m.eval(), config


def _check(fmt: str):
    @torch.no_grad()
    def check(src, out: Path, target: Target) -> tuple[torch.Tensor, torch.Tensor, bool]:
        back, _ = read_eagle3_dir(out, target)
        a, b = src.module.eval(), back.to(next(src.module.parameters()).dtype)
        g = torch.Generator().manual_seed(0)
        H = a.config.hidden_size
        feats = torch.randn(1, 6, 3 * H, generator=g).to(a.fc.weight)
        ids = torch.randint(0, a.config.vocab_size, (1, 6 + a.ttt_steps), generator=g).to(a.fc.weight.device)
        return torch.stack(a.ttt(feats, ids, 2)), torch.stack(b.ttt(feats, ids, 2)), True
    return check


def _recognizes(fmt: str):
    def recognizes(config: dict) -> bool:
        if fmt == "vllm-eagle3":
            return config.get("speculators_model_type") == "eagle3"
        return "LlamaForCausalLMEagle3" in (config.get("architectures") or [])
    return recognizes


def _read(path: Path, target: Target):
    m, config = read_eagle3_dir(path, target)
    fmt = "vllm-eagle3" if config.get("speculators_model_type") == "eagle3" else "eagle3"
    return m, config, {"path": str(path), "format": fmt, "base_model_name_or_path":
                       config.get("base_model_name_or_path")}


for _fmt, _usage in (
        ("vllm-eagle3", "vLLM: `LLM(model=<target>, speculative_config={\"method\": \"eagle3\", "
                        "\"model\": \"<this dir>\", \"num_speculative_tokens\": K})`; draftsmith: "
                        "`draftsmith import <this dir> --out CKPT`"),
        ("eagle3", "SGLang: `--speculative-algorithm EAGLE3 --speculative-draft-model-path <this dir>`; vLLM: "
                   "`speculative_config={\"method\": \"eagle3\", \"model\": \"<this dir>\"}`; EAGLE's reference code "
                   "and SpecForge read this layout too")):
    register_format(ExportFormat(
        name=_fmt, holds=lambda s: isinstance(s.module, Eagle3Module), what="EAGLE-3 drafters",
        write=_writer(_fmt), usage=_usage, check=_check(_fmt), recognizes=_recognizes(_fmt), read=_read,
        note="The target's token embedding is not stored: engines share the target's. Layer ids are Hugging "
             "Face hidden_states indices (vLLM's eagle_aux_hidden_state_layer_ids)."))
