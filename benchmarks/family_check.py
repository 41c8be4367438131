"""Every drafter kind on a real target of another family: built from the target's config (or refused, naming what
the family lacks), and lossless there: greedy tokens of our decoder, plain and with each kind's fresh (untrained)
drafter, against the model's own ``generate``, on MT-Bench first turns and on one long prompt that passes the
target's sliding window where it has one.

    python -m benchmarks.family_check --target gemma-3-270m [--prompts 3] [--max-new-tokens 32]
        [--kinds medusa,hydra,hydra++,eagle3,kangaroo,standalone] [--threads 2] [--out FILE]

Untrained drafters propose mostly rejected tokens: every step still verifies a block through the target's masks
(the path a wrong window or RoPE would break), and a divergence is counted with the target's top-2 gap there.
float32, the model's own forward by default, so the reference and ours are the same arithmetic; ``--forward
compile`` (or fast) decodes through our static-shape forward instead, where the reference's arithmetic differs in
the order of its sums (a divergence then counts as explained at a near-tie).
"""

from __future__ import annotations

import time

import torch

from draftsmith import registry
from draftsmith.chat import has_template
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import add_forward_arg, use_fast_forward
from draftsmith.engine.kvcache import sliding_windows
from draftsmith.eval.greedy_equality import first_divergence, tie_threshold, top2
from draftsmith.eval.humaneval import long_prompt_ids
from draftsmith.eval.mtbench import mtbench_prompts
from benchmarks.common import add_common_args, parser, setup, write_json

KINDS = {
    "medusa": ("medusa", {"num_heads": 3}),
    "hydra": ("hydra", {"num_heads": 3, "prefix_layer": False}),
    "hydra++": ("hydra", {"num_heads": 3, "prefix_layer": True}),
    "eagle3": ("eagle3", {"vocab_keep": None}),  # aux_layers: the convention [2, N/2, N-3] for the target's N
    "kangaroo": ("kangaroo", {"exit_layer": 2}),
    "standalone": ("standalone", {"init": "target", "num_layers": 2}),
}


def reference(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None,
                         temperature=None)
    return out[0, len(ids):].tolist()


def main(argv=None) -> dict:
    ap = parser("family_check", __doc__)
    ap.add_argument("--prompts", type=int, default=3, help="MT-Bench first turns (spread over the categories)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--kinds", default=",".join(KINDS))
    add_forward_arg(ap, default="eager")
    add_common_args(ap, threads=True, threads_default=2, seed=True, out="file", out_required=False)
    b = setup(ap.parse_args(argv), out_file=True, layout=False)
    a, target = b.args, b.target
    model, tok = target.model, target.tokenizer
    cfg = model.config.get_text_config(decoder=True)
    windows = sliding_windows(cfg)
    span = (min(windows.values()) if windows else 512) + 64
    prompts = [(f"mtbench-{p.question_id}", p.ids) for p in mtbench_prompts(tok, a.prompts, spread=True)]
    prompts.append((f"long-{span}", long_prompt_ids(tok, 1, span)[0]))
    report = {"target": target.name, "model_type": cfg.model_type, "chat_template": has_template(tok),
              "sliding_windows": windows, "prompt_tokens": {k: len(v) for k, v in prompts},
              "max_new_tokens": a.max_new_tokens, "kinds": {}}
    print(f"{target.name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, windows {windows or 'none'}, "
          f"chat template {'yes' if report['chat_template'] else 'no (plain completion)'}; prompts "
          + ", ".join(f"{k} {len(v)} tokens" for k, v in prompts), flush=True)
    t0 = time.perf_counter()
    refs = {k: reference(model, ids, a.max_new_tokens) for k, ids in prompts}
    report["reference_s"] = round(time.perf_counter() - t0, 1)
    report["forward"] = use_fast_forward(target, a.forward)
    print(f"reference by generate in {report['reference_s']} s; our decoder's forward: {report['forward']}",
          flush=True)
    methods = {"plain": None, **{k: KINDS[k] for k in a.kinds.split(",")}}
    for name, spec in methods.items():
        row: dict = {"equal": 0, "divergences": [], "tokens": 0, "forwards": 0}
        try:
            drafter = None
            if spec is not None:
                torch.manual_seed(a.seed)
                kind, fields = spec  # EAGLE-3's aux layers: derived from the target's layer count
                drafter = registry.get(kind).for_target(target, **fields).eval().decoder_drafter(
                    target, target.fingerprint)
            dec = SpeculativeDecoder(target, drafter)
            t = time.perf_counter()
            for key, ids in prompts:
                try:
                    res = dec.generate(ids, a.max_new_tokens)
                except ValueError as e:  # this prompt refused (e.g. past a drafter's context), the others run
                    row.setdefault("refused_prompts", []).append({"prompt": key, "reason": str(e)})
                    continue
                row["tokens"] += len(res.tokens)
                row["forwards"] += res.target_forwards
                i = first_divergence(refs[key], res.tokens)
                if i is None:
                    row["equal"] += 1
                    continue
                gap, top1 = top2(target, ids + refs[key][:i]) if i < len(refs[key]) else (float("nan"), 0.0)
                row["divergences"].append({"prompt": key, "position": i, "top2_gap": gap,
                                           "near_tie": bool(gap < tie_threshold(top1, torch.float32))})
            row["seconds"] = round(time.perf_counter() - t, 1)
            row["tau"] = round(row["tokens"] / max(1, row["forwards"]), 3)
            row["status"] = "built"
        except ValueError as e:
            row = {"status": "refused", "reason": str(e)}
        report["kinds"][name] = row
        if row["status"] == "built":
            unexplained = sum(not d["near_tie"] for d in row["divergences"])
            refused = row.get("refused_prompts", [])
            ran = len(prompts) - len(refused)
            print(f"  {name:11s} {row['equal']}/{ran} equal to generate, {unexplained} unexplained divergences, tau "
                  f"{row['tau']} ({row['seconds']} s)" + "".join(f"; {r['prompt']} refused: {r['reason']}"
                                                              for r in refused), flush=True)
        else:
            print(f"  {name:11s} refused: {row['reason']}", flush=True)
    report["pass"] = all(r["status"] == "refused" or not any(not d["near_tie"] for d in r["divergences"])
                         for r in report["kinds"].values())
    print(f"lossless on every built kind: {report['pass']}")
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
