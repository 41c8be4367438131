"""Standalone drafters side by side on MT-Bench first turns, one interleaved run.

    python -m benchmarks.standalone_table CKPT [CKPT ...] [--prompts 80] [--max-new-tokens 128]
        [--temperature 0 1] [--draft-len 4] [--hf-assisted] --out DIR

For every standalone checkpoint (any divergence, kept-vocabulary size) it
decodes with our lossless decoder: ``renorm`` (the pruned proposal, q = 0 off
the kept ids; for a full-vocabulary drafter simply the drafter) and, when the
checkpoint has an RDK map, ``rdk`` (q_RDK); with ``--hf-assisted`` also
Hugging Face assisted generation with the same drafter exported as a plain
model (full-size head) at the same draft length. Baselines: our plain
decoding and HF ``generate``, interleaved prompt by prompt.

Figures per method (docs/methods.md section 11): tau (tokens per target forward),
alpha (accepted / tested drafts over every depth, i.e. the pooled per-position
acceptance), accept@1, tokens/s and the speedup over our plain decoding, the
draft time per drafted token from the decoder's own timers, and at
temperature 0 how many outputs equal plain greedy decoding token for token
and HF ``generate`` (``--hf-export DIR``: HF assisted with an exported directory,
loaded as transformers loads it, must give the target's own greedy output).
Writes DIR/report.json and DIR/table.md.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import AutoModelForCausalLM

from benchmarks.common import add_common_args, draft_ms_per_token, parser, provenance, setup, write_json
from draftsmith.checkpoint import load_checkpoint
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.metrics import summarize
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.bench import Method, hf_assisted, hf_generate, ours


def variants(ckpt: Path, target, ks: int | list[int], sampling: SamplingParams, hf: bool,
             rdk: bool = True) -> list[tuple[Method, dict]]:
    """Our decoder with the checkpoint's drafter at each draft length in ``ks`` (renorm, and rdk when it has
    a map and ``rdk``), and HF assisted at the same lengths."""
    ks = [ks] if isinstance(ks, int) else list(ks)
    module, manifest = load_checkpoint(ckpt, target, device=next(target.model.parameters()).device)
    if manifest["kind"] != "standalone":
        raise ValueError(f"{ckpt} holds a {manifest['kind']!r} drafter; this table is for standalone drafters")
    name = (manifest.get("recipe") or {}).get("name") or ckpt.name
    info = {"checkpoint": str(ckpt), "vocab_keep": module.config.vocab_keep, "vocab": target.vocab_size,
            "divergence": module.config.divergence, "lora": module.config.lora is not None}
    out = []
    for use_rdk in ([False, True] if module.rdk is not None and rdk else [False]):
        d = module.decoder_drafter(target, target.fingerprint, f"{name}/{'rdk' if use_rdk else 'renorm'}",
                                   use_rdk=use_rdk)
        for k in ks:
            dec = SpeculativeDecoder(target, d, policy=FixedLength(k), sampling=sampling)
            out.append((ours(f"{d.name} K={k}", dec), {**info, "rdk": use_rdk, "draft_len": k, "drafter": d}))
    if hf:
        asst = module.to_hf_model().to(next(target.model.parameters()).device).eval()
        for k in ks:
            out.append((hf_assisted(target, asst, k, sampling, name=f"HF assisted {name} K={k}"),
                        {**info, "rdk": False, "full_head": True, "draft_len": k}))
    return out


def pooled_alpha(results) -> float | None:
    """Accepted drafts / tested drafts over every depth (a chain stops testing at its first rejection)."""
    steps = [s for r in results for s in r.steps]
    tested = sum(min(s.attempted, s.accepted + 1) for s in steps)
    return sum(s.accepted for s in steps) / tested if tested else None


def run(a) -> dict:
    bench = setup(a, checkpoint=a.checkpoint[0])
    target = bench.target
    prompts = bench.prompts(a.prompts)
    report = {**provenance(), "args": vars(a), "runs": {}}
    for temp in a.temperature:
        sampling = SamplingParams(temp)
        plain_dec = SpeculativeDecoder(target, None, sampling=sampling)
        methods = [(ours("ours plain", plain_dec), {}), (hf_generate(target, sampling), {})]
        for c in a.checkpoint:
            methods += variants(Path(c), target, a.draft_len, sampling, a.hf_assisted, rdk=not a.no_rdk)
        for h in a.hf_export:  # an exported directory, loaded as HF loads it
            asst = AutoModelForCausalLM.from_pretrained(h, local_files_only=True).to(
                next(target.model.parameters()).device).eval()
            for k in a.draft_len:
                methods.append((hf_assisted(target, asst, k, sampling, name=f"HF assisted {h} K={k}"),
                                {"hf_export": h, "draft_len": k}))
        bench.apply_layout(*[i["drafter"] for _, i in methods if "drafter" in i])
        for m, _ in methods:  # warm-up: cache allocation and kernels out of the timings
            m.run(prompts[0].ids, 8, a.seed)
        per = {m.name: [] for m, _ in methods}
        t0 = time.time()
        for j, p in enumerate(prompts):
            for m, _ in methods:
                per[m.name].append(m.run(p.ids, a.max_new_tokens, a.seed + j))
            print(f"[{j + 1}/{len(prompts)}] T={temp} q{p.question_id} {time.time() - t0:.0f}s", flush=True)
        base = summarize(per["ours plain"])["tokens_per_s"]
        rows = {}
        for m, info in methods:
            rs = per[m.name]
            s = summarize(rs)
            row = {k: v for k, v in info.items() if k != "drafter"}
            row.update(tau=s["tau"], tokens_per_s=s["tokens_per_s"], speedup_vs_plain=s["tokens_per_s"] / base,
                       alpha=pooled_alpha(rs), accept_at_1=(s["acceptance_by_position"] or [None])[0],
                       draft_ms_per_token=draft_ms_per_token(rs))
            if sampling.greedy:
                row["equal_to_plain"] = sum(r.tokens == q.tokens for r, q in zip(rs, per["ours plain"]))
                row["equal_to_hf_generate"] = sum(r.tokens == q.tokens for r, q in zip(rs, per["HF generate"]))
            rows[m.name] = row
        report["runs"][f"T={temp}"] = {"prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "methods": rows}
    out = bench.out
    write_json(out / "report.json", report)
    (out / "table.md").write_text(table(report))
    print(table(report))
    return report


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(report: dict) -> str:
    lines = []
    for label, r in report["runs"].items():
        lines += [f"## {label}, {r['prompts']} MT-Bench first turns, {r['max_new_tokens']} new tokens", "",
                  "| method | kept ids | divergence | alpha | accept@1 | tau | tokens/s | vs plain | draft ms/token "
                  "| = plain | = HF generate |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in r["methods"].items():
            keep = s.get("vocab_keep")
            kept = "-" if "vocab" not in s else (f"{keep} ({100 * keep / s['vocab']:.0f}%)" if keep else "all")
            lines.append(f"| {name} | {kept} | {s.get('divergence', '-')} | {_f(s['alpha'])} | {_f(s['accept_at_1'])} "
                         f"| {s['tau']:.3f} | {s['tokens_per_s']:.2f} | {s['speedup_vs_plain']:.2f}x "
                         f"| {_f(s['draft_ms_per_token'], '{:.2f}')} | {s.get('equal_to_plain', '-')} "
                         f"| {s.get('equal_to_hf_generate', '-')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = parser("standalone_table", __doc__)
    ap.add_argument("checkpoint", nargs="+", help="standalone drafter checkpoint directories")
    add_common_args(ap, target_default=None, device=True, seed=True, out="dir")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--draft-len", type=int, nargs="+", default=[4], help="one or more draft lengths K")
    ap.add_argument("--no-rdk", action="store_true", help="skip the RDK variants of checkpoints that have a map")
    ap.add_argument("--hf-assisted", action="store_true", help="also HF assisted generation with each exported drafter")
    ap.add_argument("--hf-export", action="append", default=[], metavar="DIR",
                    help="also HF assisted generation with an `draftsmith export --to hf` directory (repeatable)")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
