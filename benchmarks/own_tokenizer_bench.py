"""Benchmark a drafter with its own tokenizer: TLI and SLEM (ours) vs Hugging Face universal assisted
generation with the same drafter, and plain decoding, on MT-Bench first turns, interleaved.

    python -m benchmarks.own_tokenizer_bench CKPT --prompts 80 --max-new-tokens 128 \\
        --draft-len 4 --temperature 0 0.7 --out runs/own-tokenizer/eval80

Methods per temperature: ours plain (the baseline every speedup names), HF generate, ours TLI K,
ours SLEM K (greedy only), HF universal assisted generation K (``generate(assistant_model=...,
tokenizer=..., assistant_tokenizer=...)`` with the checkpoint exported as a plain HF directory;
greedy: HF's string-level candidate generator, sampling: its universal speculative decoding). K is
the draft length in drafter tokens for HF and SLEM (SLEM proposes at most K target tokens), in target
tokens for TLI (each TLI draft is one shared token). At temperature 0 every method's tokens are
compared with plain decoding (they must be equal; mismatches are counted in the report); at a sampled
temperature the mean target NLL per token of each method's outputs is reported (lossless methods match
plain sampling within noise; HF's universal assisted generation with sampling does not: docs/DECISIONS.md).
Writes OUT/report.json (figures, command, environment) and OUT/report.md.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from benchmarks.common import add_common_args, parser, provenance, recording, setup, write_json
from draftsmith.checkpoint import load_checkpoint
from draftsmith.drafters.own_tokenizer.decode import slem_drafter, tli_drafter
from draftsmith.drafters.own_tokenizer.model import hf_assistant
from draftsmith.engine.cpu_layout import cpu_decode_layout
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.bench import BASELINE, Method, hf_generate, hf_run, ours, run_bench, table


def hf_universal(target, model, tokenizer, k: int, sampling: SamplingParams) -> Method:
    """HF universal assisted generation with a drafter of another tokenizer (constant k drafts, no threshold)."""
    asst = copy.copy(model)
    asst.generation_config = copy.deepcopy(model.generation_config)
    asst.generation_config.num_assistant_tokens = int(k)
    asst.generation_config.num_assistant_tokens_schedule = "constant"
    asst.generation_config.assistant_confidence_threshold = 0.0
    extra = {"assistant_model": asst, "tokenizer": target.tokenizer, "assistant_tokenizer": tokenizer}
    return Method(f"HF universal assisted K={k}", hf_run(target, sampling, extra), "hf")


def methods_for(target, module, hf_dir: Path, k: int, sampling: SamplingParams, slem_extra: int,
                hf: bool = True, layout: bool = True) -> list[Method]:
    """The comparison set for one sampling setting (see the module docstring)."""
    out = [ours(BASELINE, SpeculativeDecoder(target, sampling=sampling))]
    if hf:
        out.append(hf_generate(target, sampling))
    tli = tli_drafter(module, target)
    out.append(ours(f"ours TLI K={k}", SpeculativeDecoder(target, tli, policy=FixedLength(k), sampling=sampling)))
    if sampling.greedy:
        slem = slem_drafter(module, target, extra=slem_extra)
        out.append(ours(f"ours SLEM K={k}", SpeculativeDecoder(target, slem, policy=FixedLength(k),
                                                               sampling=sampling)))
    if hf:
        model, tok = hf_assistant(hf_dir)
        if layout:  # the same decoding layout as our copy of the drafter (values unchanged)
            cpu_decode_layout(model)
        out.append(hf_universal(target, model, tok, k, sampling))
    return out


@torch.no_grad()
def target_nll(target, prompts, outputs: list[list[int]], sampling: SamplingParams) -> float:
    """Mean negative log-likelihood per token of ``outputs`` under the target's sampling distribution
    (temperature applied, no top-k/top-p). A lossless method matches plain sampling's within noise; a lossy
    one shows (HF's universal assisted generation with sampling did: docs/DECISIONS.md)."""
    total, n = 0.0, 0
    dev = next(target.model.parameters()).device
    for pr, out in zip(prompts, outputs):
        if not out:
            continue
        x = torch.tensor([list(pr.ids) + list(out)], device=dev)
        lg = target.model(x).logits[0, len(pr.ids) - 1:-1].float() / max(sampling.temperature, 1e-6)
        total += float(torch.nn.functional.cross_entropy(lg, torch.tensor(out, device=dev), reduction="sum"))
        n += len(out)
    return total / max(n, 1)


def main(argv: list[str] | None = None) -> int:
    ap = parser("own_tokenizer_bench", __doc__)
    ap.add_argument("checkpoint")
    add_common_args(ap, target=False, threads=True, cpu_layout=True, out="dir")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--slem-extra", type=int, default=0, help="SLEM: drafter tokens written beyond K")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate and HF universal assisted generation")
    a = ap.parse_args(argv)
    bench = setup(a, checkpoint=a.checkpoint)
    target, out = bench.target, bench.out
    module, manifest = load_checkpoint(a.checkpoint, target)
    hf_dir = Path(tempfile.mkdtemp(prefix="own-tok-hf-"))
    module.export_hf(hf_dir, target)  # before the CPU layout: the export holds the plain weights
    bench.apply_layout(module)
    prompts = bench.prompts(a.prompts)
    report = {"checkpoint": a.checkpoint, "manifest_metrics": manifest.get("metrics"), "runs": {}, **provenance()}
    md = [f"# own-tokenizer drafter {a.checkpoint} on {target.name}", ""]
    for temp in a.temperature:
        s = SamplingParams(temp)
        methods, results = recording(methods_for(target, module, hf_dir, a.draft_len, s, a.slem_extra,
                                                 hf=not a.no_hf, layout=a.cpu_layout))
        figs = run_bench(methods, prompts, a.max_new_tokens, log=print)
        got = {name: [list(r.tokens) for r in rs] for name, rs in results.items()}  # the warm-up run first
        if s.greedy:  # every method must give the plain greedy tokens, prompt by prompt
            base = got[BASELINE][1:]
            figs["greedy_mismatches_vs_plain"] = {name: sum(x != y for x, y in zip(toks[1:], base))
                                                  for name, toks in got.items()}
            print(f"greedy outputs differing from plain decoding (prompts): {figs['greedy_mismatches_vs_plain']}")
        else:  # lossless methods sample the target's distribution: their outputs' likelihood matches plain's
            figs["target_nll_per_token"] = {name: target_nll(target, prompts, toks[1:], s)
                                            for name, toks in got.items()}
            print(f"mean target NLL per token of the sampled outputs: {figs['target_nll_per_token']}")
        figs["table"] = table(figs)
        report["runs"][f"T={temp}"] = figs
        md += [f"## temperature {temp}, {len(prompts)} prompts, {a.max_new_tokens} new tokens", "", "```",
               figs["table"], "```", ""]
        print(figs["table"])
    write_json(out / "report.json", report)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
