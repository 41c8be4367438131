"""Exact output distributions by enumerating every random choice (for losslessness tests).

`BranchingSource` is a `RandomSource` that follows a script of choices and
records every branch point with its exact probability: ``accept(ratio)``
branches into accept (min(1, ratio)) and reject, ``categorical(probs)`` into
every token with non-zero probability. `enumerate_branches` re-runs a
function once per leaf of that choice tree (depth-first).

`exact_distribution` applies this to the decoder's own phases: for a decode
state it enumerates every draft tree (`SpeculativeDecoder.draft`), runs the
real target forward once per tree, enumerates every verification outcome
(`SpeculativeDecoder.verify`), then replays one branch per distinct output,
commits it (real KV compaction and drafter bookkeeping) and recurses. The
result is the decoder's exact distribution over outputs, in float64 when the
models are float64; `target_distribution` is the reference computed from
plain full-sequence forwards of the target.

In bf16/fp16 the decoder is lossless w.r.t. the target as its verification
forwards compute it (docs/methods.md): `record_forwards` keeps every row those
forwards computed and `forwards_distribution` is the autoregressive
distribution of exactly those logits, the reference in that dtype.
`exact_distribution` groups continuations by the emitted tokens: exact when
a row rounds alike whatever else its forward carries, an approximation within
the forwards' disagreement otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch

from draftsmith.engine.sampling import processed_probs


class BranchingSource:
    """Follows ``script`` (indices of choices), then takes choice 0 and records the alternatives."""

    def __init__(self, script: list[int]):
        self.script = list(script)
        self.choices: list[int] = []
        self.widths: list[int] = []
        self.weight = 1.0

    def _choose(self, options: list[tuple[Any, float]]) -> Any:
        j = len(self.choices)
        k = self.script[j] if j < len(self.script) else 0
        self.choices.append(k)
        self.widths.append(len(options))
        self.weight *= options[k][1]
        return options[k][0]

    def accept(self, ratio: float) -> bool:
        a = min(1.0, max(0.0, float(ratio)))
        return self._choose([(v, w) for v, w in ((True, a), (False, 1.0 - a)) if w > 0.0])

    def categorical(self, probs: torch.Tensor) -> int:
        p = probs.double()
        p = p / p.sum()
        nz = torch.nonzero(p > 0).flatten().tolist()
        return self._choose([(int(i), float(p[i])) for i in nz])


def enumerate_branches(fn: Callable[[BranchingSource], Any]) -> list[tuple[Any, float, list[int]]]:
    """Every leaf of ``fn``'s choice tree as (result, probability, script)."""
    out, stack = [], [[]]
    while stack:
        script = stack.pop()
        src = BranchingSource(script)
        res = fn(src)
        for j in range(len(script), len(src.widths)):
            for k in range(1, src.widths[j]):
                stack.append(src.choices[:j] + [k])
        out.append((res, src.weight, src.choices))
    return out


def exact_distribution(dec, prompt: list[int], max_new_tokens: int) -> dict[tuple[int, ...], float]:
    """The decoder's exact distribution over outputs of at most ``max_new_tokens`` tokens."""

    def outputs(state) -> dict[tuple[int, ...], float]:
        if state.done:
            return {(): 1.0}
        groups: dict[tuple[int, ...], list] = {}
        mass: dict[tuple[int, ...], float] = defaultdict(float)
        for tree, wd, sd in enumerate_branches(lambda rng: dec.draft(state, rng)):
            logits, _ = dec.verify_forward(state, tree)
            for verdict, wv, sv in enumerate_branches(lambda rng: dec.verify(state, tree, logits, rng)):
                key = _emitted(dec, state, verdict.tokens)
                mass[key] += wd * wv
                groups.setdefault(key, (sd, sv))
        total: dict[tuple[int, ...], float] = defaultdict(float)
        room = state.max_new_tokens - state.emitted
        for key, (sd, sv) in groups.items():
            if len(key) >= room or key[-1] in dec.eos:  # this output ends the generation
                total[key] += mass[key]
                continue
            child = state.clone()
            tree = dec.draft(child, BranchingSource(sd))
            logits, hidden = dec.verify_forward(child, tree)
            verdict = dec.verify(child, tree, logits, BranchingSource(sv))
            out = dec.commit(child, tree, verdict, hidden)
            assert tuple(out) == key, (out, key)
            for rest, w in outputs(child).items():
                total[key + rest] += mass[key] * w
        return total

    with torch.no_grad():
        return dict(outputs(dec.start(prompt, max_new_tokens)))


def _emitted(dec, state, tokens: list[int]) -> tuple[int, ...]:
    """What commit would emit: cut after the first EOS."""
    out = []
    for t in tokens:
        out.append(t)
        if t in dec.eos:
            break
    return tuple(out)


@torch.no_grad()
def target_distribution(target, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                        top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """The target's own distribution over outputs, from full-sequence forwards without any cache."""
    eos = set(target.eos_token_ids)
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: list[int], w: float, left: int) -> None:
        if left == 0 or (len(seq) > len(prompt) and seq[-1] in eos):
            out[tuple(seq[len(prompt):])] = out.get(tuple(seq[len(prompt):]), 0.0) + w
            return
        logits = target.model(torch.tensor([seq], device=target.model.device)).logits[0, -1]
        p = processed_probs(logits, temperature, top_k, top_p).double()
        p = p / p.sum()
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(seq + [t], w * float(p[t]), left - 1)

    walk(list(prompt), 1.0, max_new_tokens)
    return out


def total_variation(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)



def record_forwards(dec) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Wrap ``dec.verify_forward`` so that every row of every verification forward is kept: context (the
    tokens the row predicts after) -> the fp32 logits rows computed for it, in order."""
    rows: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
    inner = dec.verify_forward

    def forward(state, tree):
        logits, hidden = inner(state, tree)
        toks, _ = tree.host_tokens()
        base = state.tokens[: state.length + 1]
        for i in range(tree.n + 1):
            rows[tuple(base + [toks[j] for j in tree.path(i)[1:]])].append(logits[i].float().cpu())
        return logits, hidden

    dec.verify_forward = forward
    return rows


@torch.no_grad()
def forwards_distribution(rows: dict, prompt: list[int], max_new_tokens: int, sampling, eos, fallback: Callable
                          ) -> tuple[dict[tuple[int, ...], float], float, int]:
    """The autoregressive distribution of the logits the decoder's own forwards computed (`record_forwards`):
    the reference of losslessness in the forward's dtype. Returns (distribution, spread, missing): ``spread``
    is the largest |logit| difference between two forwards of one context (0 when a row rounds alike whatever
    else its forward carries; the reference is then unambiguous), ``missing`` counts contexts no forward
    computed, whose logits come from ``fallback(context)`` (a lossless decoder leaves none with mass)."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    spread, missing = 0.0, 0

    def walk(seq: list[int], w: float, left: int) -> None:
        nonlocal spread, missing
        if left == 0 or (len(seq) > len(prompt) and seq[-1] in eos):
            out[tuple(seq[len(prompt):])] += w
            return
        got = rows.get(tuple(seq))
        if got:
            spread = max([spread] + [float((r - got[0]).abs().max()) for r in got[1:]])
            logits = got[0]
        else:
            missing += 1
            logits = fallback(seq).float().cpu()
        p = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p).double()
        p = p / p.sum()
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(seq + [t], w * float(p[t]), left - 1)

    walk(list(prompt), 1.0, max_new_tokens)
    return dict(out), spread, missing
