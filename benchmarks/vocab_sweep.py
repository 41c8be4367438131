"""A pruned draft vocabulary at several sizes: what it covers, what it caps acceptance at, what it costs to draft.

    python -m benchmarks.vocab_sweep --data RUN_DIR --target NAME [--sizes 2048,4096,8192,16384,32768,all]
        [--positions 4000] [--threads 2] [--calls 200] [--calibration-every 20] --out FILE

RUN_DIR is a run whose cache stage wrote ``cache/train`` and ``cache/heldout`` with the target's final hidden
states (every recipe with a heads, EAGLE-3 or standalone drafter). For each size N the kept ids are chosen as
training does (`draftsmith.common.vocab.frequent_ids`: the N most frequent assistant-token ids of the training
sequences, the calibration split left out), and measured:

* ``train_coverage``: the share of the training assistant tokens that are kept ids;
* ``heldout_coverage``: the same share of the held-out answers (the target's own greedy answers to MT-Bench
  first turns): at T=0 a drafter over these ids can match the target at most this often, so it caps the
  acceptance of every draft position;
* ``heldout_kept_mass``: the target's mean probability on the kept ids over held-out positions (its logits
  recomputed from the cached states, up to ``--positions`` of them): a perfectly distilled drafter over the kept
  ids is accepted with exactly this probability at T=1 (sum over kept ids of min(p, p / Z) = Z), so it caps T=1
  acceptance;
* the draft head's product for one row: ``bf16_ms`` (torch's bf16 product) and ``int8_ms`` (the weight-only int8
  product drafting uses on a CPU in bf16, `draftsmith.common.int8.Int8Linear`), every size measured in turn in
  each of ``--rounds`` rounds over the same process, medians reported; N = ``all`` is the target's full output head.

Only the rows the drafter reads change with N; the rest of a draft step (its layers) does not, so the ms here are
what pruning saves per drafted token.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_common_args, parser, provenance, setup, write_json
from draftsmith.common.chunks import calibration_split
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.common.int8 import Int8Linear
from draftsmith.common.vocab import answer_coverage, frequent_ids


def parse_sizes(text: str, vocab: int) -> list[int]:
    """``2048,8192,all`` as id counts; ``all`` is the whole vocabulary. A size outside 1..vocab is an error."""
    out = []
    for part in text.split(","):
        part = part.strip()
        n = vocab if part == "all" else int(part)
        if not 1 <= n <= vocab:
            raise SystemExit(f"--sizes: {part} is not between 1 and the vocabulary's {vocab} ids")
        out.append(n)
    return sorted(set(out))


def coverage(cache: HiddenCache, seqs, kept: np.ndarray) -> tuple[float, int]:
    """`answer_coverage` over the sequences ``seqs`` of ``cache``."""
    seqs = list(seqs)
    return answer_coverage((cache.tokens(i) for i in seqs), (cache.mask(i) for i in seqs), kept)


@torch.no_grad()
def kept_mass(held: HiddenCache, target, kept_sets: dict[int, torch.Tensor], positions: int,
              batch: int = 256) -> tuple[dict[int, float], dict[int, float], int]:
    """Mean target probability on each kept set, and the share of positions whose argmax is kept, over at most
    ``positions`` held-out positions that predict an answer token."""
    mass = {n: 0.0 for n in kept_sets}
    top = {n: 0 for n in kept_sets}
    masks = {n: torch.zeros(target.vocab_size, dtype=torch.bool) for n in kept_sets}
    for n, ids in kept_sets.items():
        masks[n][ids] = True
    used = 0
    for i in range(len(held)):
        if used >= positions:
            break
        rows = np.nonzero(np.asarray(held.mask(i))[1:] > 0)[0][: positions - used]  # position t predicts t + 1
        for s in range(0, len(rows), batch):
            r = rows[s:s + batch]
            h = held.states(i, "final", int(r[0]), int(r[-1]) + 1)[torch.from_numpy(r - r[0])]
            p = torch.softmax(teacher_logits(target, h).float(), dim=-1)
            arg = p.argmax(-1)
            for n in kept_sets:
                mass[n] += float(p[:, masks[n]].sum())
                top[n] += int(masks[n][arg].sum())
        used += len(rows)
    return ({n: v / max(used, 1) for n, v in mass.items()}, {n: v / max(used, 1) for n, v in top.items()}, used)


def time_heads(weight: torch.Tensor, kept_sets: dict[int, torch.Tensor], rounds: int, calls: int) -> dict:
    """Median ms of one row through each size's head, bf16 and int8, all sizes in turn in every round."""
    x = torch.randn(1, weight.shape[1]).to(torch.bfloat16)
    heads = {}
    for n, ids in kept_sets.items():
        w = weight[ids].to(torch.bfloat16).contiguous()
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight.data = w
        heads[n] = (w, Int8Linear(lin))
    got = {n: {"bf16": [], "int8": []} for n in kept_sets}
    for _ in range(rounds):
        for n, (w, q) in heads.items():
            for name, fn in (("bf16", lambda: torch.nn.functional.linear(x, w)), ("int8", lambda: q(x))):
                fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                got[n][name].append(1e3 * (time.perf_counter() - t0) / calls)
    return {n: {k: statistics.median(v) for k, v in d.items()} for n, d in got.items()}


def main(argv=None) -> dict:
    ap = parser("vocab_sweep", __doc__)
    ap.add_argument("--data", required=True, help="a run directory holding cache/train and cache/heldout")
    ap.add_argument("--sizes", default="2048,4096,8192,16384,32768,all")
    ap.add_argument("--positions", type=int, default=4000, help="held-out positions for the kept mass")
    ap.add_argument("--calibration-every", type=int, default=20,
                    help="the recipe's train.calibration_every: those sequences are left out of the count")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    add_common_args(ap, threads=True, threads_default=2, out="file")
    a = ap.parse_args(argv)
    target = setup(a, out_file=True).target
    train = HiddenCache(Path(a.data) / "cache" / "train", target)
    held = HiddenCache(Path(a.data) / "cache" / "heldout", target)
    if "final" not in held.index["needs"]:
        raise SystemExit(f"{a.data}: the held-out cache has no final hidden states ({held.index['needs']})")
    vocab = target.vocab_size
    sizes = parse_sizes(a.sizes, vocab)
    skip = calibration_split(len(train), a.calibration_every)
    seqs = [i for i in range(len(train)) if i not in skip]
    kept_sets = {n: frequent_ids((train.tokens(i) for i in seqs), (train.mask(i) for i in seqs), vocab, n)
                 for n in sizes}
    mass, top, used = kept_mass(held, target, kept_sets, a.positions)
    cost = time_heads(target.lm_head.weight.detach().float(), kept_sets, a.rounds, a.calls)
    rows = []
    for n in sizes:
        kept = kept_sets[n].numpy()
        tr, tr_total = coverage(train, seqs, kept)
        he, he_total = coverage(held, range(len(held)), kept)
        rows.append({"kept": n, "share_of_vocab": n / vocab, "train_coverage": tr, "heldout_coverage": he,
                     "heldout_argmax_kept": top[n], "heldout_kept_mass": mass[n],
                     "bf16_ms": cost[n]["bf16"], "int8_ms": cost[n]["int8"]})
    report = {"target": target.name, "fingerprint": target.fingerprint, "vocab": vocab, "hidden": target.hidden_size,
              "data": str(a.data), "train_sequences": len(seqs), "train_answer_tokens": tr_total,
              "heldout_sequences": len(held), "heldout_answer_tokens": he_total, "heldout_positions": used,
              "threads": torch.get_num_threads(), "rows": rows, **provenance()}
    write_json(a.out, report)
    print(f"{target.name}: vocabulary {vocab}, {len(seqs)} training sequences ({tr_total} answer tokens), "
          f"{len(held)} held-out ({he_total}; {used} positions for the mass), {torch.get_num_threads()} threads")
    print("| kept ids | share | train coverage | held-out coverage | held-out argmax kept | held-out kept mass "
          "| head bf16 ms | head int8 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kept']} | {100 * r['share_of_vocab']:.1f}% | {100 * r['train_coverage']:.2f}% | "
              f"{100 * r['heldout_coverage']:.2f}% | {100 * r['heldout_argmax_kept']:.2f}% | "
              f"{100 * r['heldout_kept_mass']:.2f}% | {r['bf16_ms']:.3f} | {r['int8_ms']:.3f} |")
    return report


if __name__ == "__main__":
    main()
