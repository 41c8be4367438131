"""Export drafters to the layouts serving engines load; import them back.

    draftsmith export CKPT --to FORMAT --out DIR [--target T] [--base-model NAME]
    draftsmith export first-layers:N --to hf --out DIR [--target T]
    draftsmith import SRC --out CKPT [--target T]

Formats: a kind that an engine serves brings its own in its folder's ``export.py`` (registered with
`draftsmith.registry.register_format`, found by the registry): ``vllm-medusa`` (Medusa heads in vLLM's
names plus the TGI / original Medusa file, `draftsmith.heads.medusa.export`), ``vllm-eagle3`` and
``eagle3`` (EAGLE-3 in the speculators and EAGLE/SGLang layouts, `draftsmith.drafters.eagle3.export`).
Two more hold any drafter that fits them:
  * ``hf``: a drafter with ``to_hf_model() -> PreTrainedModel`` (standalone drafters, the untrained
    ``first-layers:N`` baseline) as a plain Hugging Face causal-LM directory, for transformers' assisted
    generation, vLLM's ``draft_model`` and SGLang's STANDALONE;
  * ``draftsmith``: our checkpoint layout plus a model card, for kinds no engine loads (Hydra, Hydra++,
    Kangaroo): ``draftsmith eval`` and the decoder load it like any checkpoint.
``draftsmith import`` reads every format a kind registers a reader for.

Every export carries provenance as top-level ``draftsmith_*`` config keys (the
place engines keep unknown keys) and a README.md model card whose YAML front
matter has ``base_model:``. Every export is loaded back before this returns
and must compute what the source computes. Export sits next to the CLI: it
uses the decoder's drafter adapters (``draftsmith.engine``), nothing imports it.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM

from draftsmith import __version__
from draftsmith.checkpoint import (CONFIG, MANIFEST, WEIGHTS, CheckpointError, MissingFileError, check_safetensors,
                                   load_checkpoint, read_json, read_manifest, save_checkpoint)
from draftsmith import registry
from draftsmith.checkpoint import config_value, drafter_from_checkpoint
from draftsmith.drafters.standalone.decode import first_layers_drafter, ModelDrafter
from draftsmith.registry import ExportFormat
from draftsmith.target import DEFAULT_TARGET, Target

FIRST_LAYERS = "first-layers:"
TREES = "trees.json"  # built trees travel with a draftsmith-format export
CARD = "README.md"


class ExportError(ValueError):
    """An export that cannot be made (the message says which formats can hold the drafter)."""


class FirstLayersBaseline:
    """The untrained ``first-layers:N`` baseline (the target's first N layers, norm and head) as an exportable
    drafter."""

    kind = "first-layers"

    def __init__(self, target: Target, n_layers: int):
        self.target, self.n_layers = target, n_layers
        self.config = {"num_layers": n_layers}

    def to_hf_model(self) -> torch.nn.Module:
        """A plain transformers causal LM (the standalone-drafter export hook)."""
        return first_layers_drafter(self.target, self.n_layers).model

    def engine_gap(self, engine: str) -> str | None:
        return None  # the target's own layers: every engine computes them


@dataclass
class Source:
    """What is being exported: the drafter, its manifest, and the checkpoint it came from (None: built here)."""

    module: Any
    manifest: dict
    path: Path | None

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])


def source_target(spec: str, target: str | None = None) -> str:
    """Target to load for ``spec``: ``target`` if given, else the checkpoint's own, else the default."""
    if target:
        return target
    if spec.startswith(FIRST_LAYERS):
        return DEFAULT_TARGET
    t = read_manifest(spec)["target"]
    return t["path"] if t.get("path") and Path(t["path"]).exists() else t.get("name", DEFAULT_TARGET)


def import_target(src: str | Path, target: str | None = None) -> str:
    """Target for importing ``src``: ``target`` if given, else its ``base_model_name_or_path`` when that is a local
    directory, else the default target."""
    if target:
        return target
    base = read_json(Path(src) / CONFIG, "exported drafter config").get("base_model_name_or_path")
    return str(base) if base and (Path(str(base)) / CONFIG).exists() else DEFAULT_TARGET


def load_source(spec: str | Path, target: Target) -> Source:
    """A checkpoint directory (fingerprint-checked against ``target``) or ``first-layers:N``."""
    s = str(spec)
    if s.startswith(FIRST_LAYERS):
        try:
            n = int(s[len(FIRST_LAYERS):])
        except ValueError:
            raise ExportError(f"{s!r}: expected first-layers:N with N an integer") from None
        total = int(target.config.num_hidden_layers)
        if not 1 <= n <= total:
            raise ExportError(f"{s!r}: N must be in [1, {total}] (the target's layers)")
        manifest = {"kind": FirstLayersBaseline.kind, "layers": n, "recipe": None, "data": None,
                    "target": {"name": target.name, "path": str(target.path), "fingerprint": target.fingerprint}}
        return Source(FirstLayersBaseline(target, n), manifest, None)
    module, manifest = load_checkpoint(spec, target)
    return Source(module, manifest, Path(spec))


def data_summary(data: dict | None) -> dict | None:
    """The manifest's data provenance without its long lists: scalars, and scalars one level down."""
    if not data:
        return None
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, dict):
            out[k] = {kk: vv for kk, vv in v.items() if isinstance(vv, (str, int, float, bool))}
    return out


def provenance(src: Source, target: Target, fmt: str) -> dict:
    """Top-level ``draftsmith_*`` keys every exported config carries."""
    return {
        "draftsmith_version": __version__, "draftsmith_format": fmt, "draftsmith_kind": src.kind,
        "draftsmith_target": target.name, "draftsmith_target_fingerprint": src.manifest["target"]["fingerprint"],
        "draftsmith_recipe": src.manifest.get("recipe"), "draftsmith_data": data_summary(src.manifest.get("data")),
        "draftsmith_source": str(src.path) if src.path else f"{FIRST_LAYERS}{src.manifest.get('layers')}",
        "draftsmith_exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ---------------------------------------------------------------- formats
def _write_hf(src: Source, out: Path, target: Target, base_model: str, prov: dict,
              num_assistant_tokens: int = 4) -> list[str]:
    model = src.module.to_hf_model()
    model.config.update(prov)
    # assisted generation reads its tuning from the assistant's generation config
    model.generation_config.num_assistant_tokens = num_assistant_tokens
    model.save_pretrained(out, safe_serialization=True)
    own = getattr(src.module, "hf_tokenizer", None)  # a drafter with its own tokenizer ships that one
    (own(target) if callable(own) else target.tokenizer).save_pretrained(out)
    return sorted(p.name for p in out.iterdir())


def _write_draftsmith(src: Source, out: Path, target: Target, base_model: str, prov: dict) -> list[str]:
    files = [f for f in (WEIGHTS, CONFIG, TREES) if (src.path / f).exists()]
    for f in files:
        shutil.copy2(src.path / f, out / f)
    manifest = dict(src.manifest)
    manifest["export"] = {k.removeprefix("draftsmith_"): v for k, v in prov.items()
                          if k in ("draftsmith_format", "draftsmith_source", "draftsmith_exported")}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    return [*files, MANIFEST]


def _check_hf(src: Source, out: Path, target: Target) -> tuple[torch.Tensor, torch.Tensor, bool]:
    ref = src.module.to_hf_model()
    new = AutoModelForCausalLM.from_pretrained(out, dtype=next(ref.parameters()).dtype, local_files_only=True)
    ids = torch.randint(0, int(ref.config.vocab_size), (1, 8))  # the drafter's own vocabulary, if it has one
    return ref(ids).logits, new(ids).logits, True


def _check_draftsmith(src: Source, out: Path, target: Target) -> None:
    new, _ = load_checkpoint(out, target)
    sa, sb = src.module.state_dict(), new.state_dict()
    if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
        raise ExportError(f"{out}: the draftsmith export does not load back to the same weights")


#: every format: those the kinds bring (their export.py), then the two any drafter may use
FORMATS: dict[str, ExportFormat] = {**registry.export_formats(), **{f.name: f for f in (
    ExportFormat("hf", lambda s: callable(getattr(s.module, "to_hf_model", None)), "standalone drafters", _write_hf,
                 "transformers: `target.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(\"<this "
                 "dir>\"))`; vLLM: `speculative_config={\"method\": \"draft_model\", \"model\": \"<this dir>\"}`; "
                 "SGLang: `--speculative-algorithm STANDALONE --speculative-draft-model-path <this dir>`",
                 check=_check_hf),
    ExportFormat("draftsmith", lambda s: s.path is not None, "every trained drafter checkpoint", _write_draftsmith,
                 "`draftsmith eval <this dir> ...` and `draftsmith.checkpoint.drafter_from_checkpoint` (no serving "
                 "engine loads this kind)"),
)}}


def formats_for(src: Source) -> list[str]:
    """Names of the formats that can hold ``src``."""
    return [name for name, f in FORMATS.items() if f.holds(src)]


def model_card(src: Source, target: Target, fmt: str, base_model: str, files: list[str], prov: dict) -> str:
    """README.md with YAML front matter (``base_model:``) and the provenance."""
    front = {"base_model": base_model, "library_name": "transformers" if fmt == "hf" else "draftsmith",
             "tags": ["speculative-decoding", "draftsmith", src.kind],
             "draftsmith": {k.removeprefix("draftsmith_"): v for k, v in prov.items() if k != "draftsmith_recipe"}}
    recipe = src.manifest.get("recipe") or {}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {src.kind} drafter for {target.name}", "",
             f"Exported by draftsmith {__version__} as `{fmt}` from `{prov['draftsmith_source']}`.", "",
             f"* target: `{target.name}`, fingerprint `{prov['draftsmith_target_fingerprint']}` (a drafter only "
             f"works with the exact target it was trained for)",
             f"* recipe: `{recipe.get('name') or 'none (untrained baseline)'}`",
             f"* data: {json.dumps(prov['draftsmith_data']) if prov['draftsmith_data'] else 'none'}",
             f"* files: {', '.join(f'`{f}`' for f in files)}", "", "## Loading", "", FORMATS[fmt].usage, ""]
    if FORMATS[fmt].note:
        lines += [FORMATS[fmt].note, ""]
    keep = config_value(src.module, "vocab_keep") if fmt == "hf" else None
    if keep:  # a pruned standalone drafter: HF assisted generation has no id map
        lines += [f"This drafter was trained to draft over {keep} kept token ids (a pruned vocabulary); the export "
                  f"holds its full-size output head, so Hugging Face drafts over the whole vocabulary (the id map "
                  f"and any RDK map stay in the draftsmith checkpoint).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- reload checks
def load_drafter(path: str | Path, target: Target):
    """A decoder drafter from a checkpoint, a draftsmith / vllm-medusa / TGI export, or an ``hf`` export."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return drafter_from_checkpoint(path, target)
    config = read_json(path / CONFIG, "exported drafter config")
    fmt = _engine_format(config)
    if fmt is not None:
        module, _, _ = fmt.read(path, target)
        p = next(target.model.parameters())
        module.to(device=p.device, dtype=p.dtype)
        return module.decoder_drafter(target, target.fingerprint, f"{module.kind} ({path.name})")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise MissingFileError(f"{path}: no *.safetensors file (an hf export holds model.safetensors)")
    for w in weights:  # a truncated file is named here, not deep inside transformers
        check_safetensors(w, "hf drafter weights")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=next(target.model.parameters()).dtype,
                                                 local_files_only=True)
    model.to(next(target.model.parameters()).device)
    return ModelDrafter(model, getattr(model.config, "draftsmith_target_fingerprint", None), name=path.name)


def _engine_format(config: dict) -> ExportFormat | None:
    """The kind's format a directory's config.json is in (None: not one a kind reads back)."""
    return next((f for f in FORMATS.values() if f.recognizes is not None and f.recognizes(config)), None)


@torch.no_grad()
def _check_reload(src: Source, out: Path, fmt: str, target: Target) -> None:
    """The export, loaded back, computes what the source computes, or an ExportError."""
    torch.manual_seed(0)
    check = FORMATS[fmt].check or _check_draftsmith
    res = check(src, out, target)
    if res is None:
        return
    a, b, exact = res
    if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-5)):
        raise ExportError(f"{out}: the {fmt} export loads back but computes other logits "
                          f"(max difference {(a - b).abs().max().item():.3g})")


# ---------------------------------------------------------------- entry points
def export(spec: str | Path, fmt: str, out: str | Path, target: Target, *, base_model: str | None = None) -> Path:
    """Export the drafter ``spec`` (a checkpoint dir or ``first-layers:N``) to ``fmt`` in ``out``, checked by reload.

    ``base_model`` (default: the target's path) is what engines load as the
    target (TGI's ``base_model_name_or_path``, the card's ``base_model:``).
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; choose a new --out")
    src = load_source(spec, target)
    if not FORMATS[fmt].holds(src):
        can = formats_for(src)
        raise ExportError(f"a {src.kind!r} drafter cannot be exported to {fmt!r} (it holds "
                          f"{FORMATS[fmt].what}); formats that can hold {src.kind!r}: "
                          f"{', '.join(can) if can else 'none'}")
    base_model = base_model or str(target.path)
    prov = provenance(src, target, fmt)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = FORMATS[fmt].write(src, tmp, target, base_model, prov)
        (tmp / CARD).write_text(model_card(src, target, fmt, base_model, files, prov))
        _check_reload(src, tmp, fmt, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written export behind
        raise
    if out.exists():
        out.rmdir()  # checked empty above
    tmp.rename(out)
    return out


def import_drafter(src: str | Path, out: str | Path, target: Target) -> Path:
    """A draftsmith checkpoint from a directory in a serving engine's layout (the kinds' formats), for ``target``."""
    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new --out")
    if not src.is_dir():
        raise MissingFileError(f"{src}: no such directory")
    config = read_json(src / CONFIG, "exported drafter config")
    fmt = _engine_format(config)
    if fmt is None:
        raise ExportError(f"{src / CONFIG}: not a layout draftsmith imports (formats it reads: "
                          f"{', '.join(f.name for f in FORMATS.values() if f.read is not None)})")
    module, config, origin = fmt.read(src, target)
    save_checkpoint(out, module, target, recipe=config.get("draftsmith_recipe"), data=config.get("draftsmith_data"),
                    extra={"imported_from": origin})
    return out


__all__ = ["FORMATS", "CheckpointError", "ExportError", "ExportFormat", "FirstLayersBaseline", "MissingFileError",
           "Source", "export", "formats_for", "import_drafter", "import_target", "load_drafter", "load_source",
           "source_target"]
