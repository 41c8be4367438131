"""Sampling distributions, random sources and lossless verification rules.

One function, `processed_probs`, turns logits into the distribution that is
sampled from, for the drafter (q) and the target (p) alike: fp32,
temperature, then top-k, then top-p. Verification is handed exactly the q a
draft token was drawn from (docs/methods.md section 1: verifying raw logits while
sampling filtered ones is the classic lossy bug).

Randomness goes through a `RandomSource` with two primitives, so tests can
inject uniforms or enumerate every branch exactly:
  * ``accept(ratio)``: draw u ~ U(0, 1) in float64, return ``u <= ratio``;
  * ``categorical(probs)``: one draw from ``probs`` (`inverse_cdf`).

One inverse CDF serves every draw: `inverse_cdf_rows` (many rows at once), of
which `inverse_cdf` is the one-row case. `pick_tokens` is the data engine's
token choice for many rows, each with its own generator (a row is anything
with a ``gen`` attribute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`processed_probs` with these settings."""
        return processed_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, the first maximal index on ties (as ``argmax``).

    ``max(-1).indices`` is documented to break ties the same way and runs 2-4x faster than ``argmax`` on CPU for
    a vocabulary-wide row (bf16 [8, 49152]: 0.15 ms against 0.66 ms on a 2-core Xeon), a cost every greedy step
    pays. tests/test_sampling.py checks the two agree on tie-heavy rows in every dtype the decoder uses."""
    return logits.max(-1).indices


def processed_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The distribution tokens are sampled from, in fp32: [..., V] -> [..., V].

    fp32 whatever the model's dtype (bf16 logits are upcast first); float64
    logits stay float64, which only the exact-enumeration tests use.

    Order: temperature, min-p (as vLLM: drop tokens whose probability is
    below ``min_p`` times the largest), then as in Hugging Face's samplers
    top-k (ties with the k-th value are kept), top-p (keep the most probable
    tokens until their mass reaches ``top_p``; the top token is always
    kept). ``temperature == 0``
    gives the one-hot argmax distribution (greedy as a degenerate sampler).
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    if temperature != 1.0:
        x = x / temperature
    if min_p > 0.0:
        pr = torch.softmax(x, dim=-1)
        x = x.masked_fill(pr < min_p * pr.amax(-1, keepdim=True), float("-inf"))
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        sp = torch.softmax(srt, dim=-1)
        before = sp.cumsum(-1) - sp  # mass of strictly more probable tokens
        drop = before >= top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(x, dim=-1)


class RandomSource(Protocol):
    """Where every random decision of the decoder comes from."""

    def accept(self, ratio: float) -> bool:
        """Draw u ~ U(0, 1) (float64) and return ``u <= ratio``."""

    def categorical(self, probs: torch.Tensor) -> int:
        """One draw from ``probs`` ([V], need not be normalised)."""


def inverse_cdf_rows(probs: torch.Tensor, u: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The token at each row's uniform ``u`` [n] (float64) on the cumulative distribution of ``probs`` [n, V]
    (vocabulary order, need not be normalised): the index i with cdf(i-1) <= u * total < cdf(i), never a
    zero-probability index.

    In two levels: block masses (float32 sums of ``block`` probabilities, accumulated in float64 across blocks),
    then a float64 cumulative sum inside the block reached. A block's mass carries float32 rounding (~6e-8 of
    it), the size of the probabilities' own; where that rounding puts a uniform past the block's float64 total,
    the block's last token of positive probability is taken. A float64 cumulative sum over the whole vocabulary
    cost 18 ms a step for 96 x 49152 on a 2-core Xeon; this, under 2 ms."""
    n, v = probs.shape
    nb = -(-v // block)
    if nb * block != v:
        probs = torch.nn.functional.pad(probs, (0, nb * block - v))
    blocks = probs.view(n, nb, block)
    bcdf = blocks.sum(-1).double().cumsum(-1)
    target = u.to(bcdf.device, torch.float64) * bcdf[:, -1]
    b = torch.searchsorted(bcdf, target[:, None], right=True)[:, 0].clamp(max=nb - 1)
    before = torch.where(b > 0, bcdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = blocks[torch.arange(n, device=probs.device), b].double().cumsum(-1)
    last = inner[:, -1]
    x = torch.minimum(target - before, torch.nextafter(last, torch.zeros_like(last)))  # below the block's total
    j = torch.searchsorted(inner, x[:, None], right=True)[:, 0].clamp(max=block - 1)
    return (b * block + j).clamp(max=v - 1)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """One draw's index from ``probs`` [V] at the uniform ``u``: `inverse_cdf_rows` for one row."""
    return int(inverse_cdf_rows(probs[None], torch.tensor([u], dtype=torch.float64))[0])


class TorchRandom:
    """Default source: a seeded CPU ``torch.Generator`` drawing float64 uniforms."""

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def uniform(self) -> float:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator))

    def accept(self, ratio: float) -> bool:
        return self.uniform() <= ratio

    def categorical(self, probs: torch.Tensor) -> int:
        return inverse_cdf(probs, self.uniform())


class UniformSource(TorchRandom):
    """Replays given uniforms, in order (for hand-computed tests); fails when they run out."""

    def __init__(self, uniforms: Sequence[float]):
        self.uniforms = list(uniforms)
        self.used = 0

    def uniform(self) -> float:
        if self.used >= len(self.uniforms):
            raise RuntimeError(f"UniformSource ran out after {self.used} uniforms")
        self.used += 1
        return float(self.uniforms[self.used - 1])


class WithoutReplacement:
    """Children of one tree node: successive draws from q, each removing the token drawn.

    ``q`` is kept in float64 and renormalised after each removal, so the k-th
    child is a draw from q with the first k-1 children removed (Sequoia).
    """

    def __init__(self, q: torch.Tensor, rng: RandomSource):
        self.q = q.double().clone()
        self.rng = rng

    def next(self) -> int | None:
        """The next child token, or None once q's support is exhausted."""
        total = float(self.q.sum())
        if total <= 0.0:
            return None
        x = self.rng.categorical(self.q / total)
        self.q[x] = 0.0
        return x


def _normalised(x: torch.Tensor) -> torch.Tensor | None:
    s = float(x.sum())
    return x / s if s > 0.0 else None


@dataclass
class NodeVerdict:
    """Outcome at one tree node: the accepted child (index into ``children``) or the token sampled instead."""

    child: int | None
    token: int | None


def verify_node(p: torch.Tensor, children: Sequence[int], q: torch.Tensor | None, rng: RandomSource) -> NodeVerdict:
    """Lossless multi-candidate rejection at one node (SpecInfer / Sequoia without replacement).

    ``p``: target distribution at the node; ``children``: draft tokens in the
    order they were drawn, without replacement, from ``q``. Child x is
    accepted with probability min(1, p(x) / q(x)); on rejection
    p <- norm(max(0, p - q)) and x is removed from q (renormalised). When every
    child fails (or there is none) a token is drawn from the remaining p. With
    one child this is exactly speculative sampling's accept / residual rule.
    """
    p64 = p.double()
    p64 = p64 / p64.sum()
    if not children:
        return NodeVerdict(None, rng.categorical(p64))
    q64 = q.double().clone()
    q64 = q64 / q64.sum()
    for i, x in enumerate(children):
        qx = float(q64[x])
        if qx <= 0.0:
            raise ValueError(f"draft token {x} has zero draft probability: it was not drawn from q")
        if rng.accept(float(p64[x]) / qx):
            return NodeVerdict(i, None)
        residual = _normalised(torch.clamp(p64 - q64, min=0.0))
        if residual is not None:  # all-zero only if p == q up to rounding; then keep p
            p64 = residual
        q64[x] = 0.0
        rest = _normalised(q64)
        if rest is None:
            break
        q64 = rest
    return NodeVerdict(None, rng.categorical(p64))


def verify_node_certain(p: torch.Tensor, children: Sequence[int], rng: RandomSource) -> NodeVerdict:
    """Lossless verification of DETERMINISTIC candidates (proposed with certainty, not drawn from a q).

    Draw the target's own token y ~ p; follow the child equal to y, else emit y. The emitted token is
    therefore exactly a draw from p (lossless by construction) and the acceptance probability is
    sum(p(x) for x in children), the most any rule can accept. With one child this is speculative
    sampling with q = one-hot(x) (accept with min(1, p(x)/1), resample from p with x removed); with
    several distinct children it is recursive rejection with one-hot proposals, each rejection removing
    the rejected token from p. No vocabulary-sized q is materialised.
    """
    p64 = p.double()
    y = rng.categorical(p64 / p64.sum())
    for i, x in enumerate(children):
        if x == y:
            return NodeVerdict(i, None)
    return NodeVerdict(None, y)


def verify_node_greedy(target_argmax: int, children: Sequence[int]) -> NodeVerdict:
    """Greedy verification: follow the child equal to the target's argmax, else emit the argmax."""
    for i, x in enumerate(children):
        if x == target_argmax:
            return NodeVerdict(i, None)
    return NodeVerdict(None, target_argmax)


TYPICAL_EPS, TYPICAL_DELTA = 0.09, 0.3


def verify_node_typical(p: torch.Tensor, children: Sequence[int], rng: RandomSource,
                        eps: float = TYPICAL_EPS, delta: float = TYPICAL_DELTA) -> NodeVerdict:
    """Medusa's typical acceptance (LOSSY at temperature > 0; only behind acceptance="typical").

    Accept the first child x with p(x) > min(eps, delta * exp(-H(p))); if none
    passes, draw a token from p.
    """
    p64 = p.double()
    ent = float(-(p64 * torch.log(p64.clamp_min(1e-30))).sum())
    thr = min(eps, delta * float(torch.exp(torch.tensor(-ent))))
    for i, x in enumerate(children):
        if float(p64[x]) > thr:
            return NodeVerdict(i, None)
    return NodeVerdict(None, rng.categorical(p64))


def verify_chain(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], rng: RandomSource) -> tuple[int, int]:
    """Speculative sampling on a chain: p [K+1, V], q [K, V], K draft tokens.

    Returns (number accepted, next token): the residual sample at the first
    rejection, or the bonus token from p[K] when all K are accepted. The same
    `verify_node` the decoder uses, applied along the chain.
    """
    for i, x in enumerate(drafts):
        v = verify_node(p[i], [x], q[i], rng)
        if v.child is None:
            return i, int(v.token)
    return len(drafts), int(verify_node(p[len(drafts)], [], None, rng).token)


# ---------------------------------------------------------------------- many rows at once (the data engine)
def _uniforms(rows: list, device) -> torch.Tensor:
    """One float64 uniform per row, each from the row's own generator (so a row's draws do not depend on which
    rows share its step)."""
    return torch.tensor([float(torch.rand((), generator=r.gen, dtype=torch.float64)) for r in rows],
                        dtype=torch.float64, device=device)


def pick_tokens(logits: torch.Tensor, rows: list, temperature: float, top_p: float) -> list[int]:
    """Next token per row: argmax (greedy) or a draw from the row's own generator.

    A draw is the inverse CDF (`inverse_cdf_rows`) at float64 uniforms from the row's generator. Top-p keeps the
    nucleus: the smallest set of most probable tokens whose mass reaches ``top_p``, together with every token
    exactly as probable as its least probable member (ties at the boundary are kept together, so the set does
    not depend on a sort's order among equal probabilities: bf16 logits tie often). It is sampled by rejection,
    which needs no sort: draw from the whole distribution; a token is in the nucleus exactly when the tokens
    strictly more probable than it hold less than ``top_p`` (always so when its own probability exceeds
    1 - top_p); otherwise that row draws again. Accepted draws follow the nucleus distribution exactly, and a
    row redraws with probability 1 - (nucleus mass) <= 1 - top_p. (A full sort of 96 x 49152 probabilities
    cost more than the step's matrix products.) The mass above a token is summed in float32.
    """
    if temperature <= 0:
        # max(dim)'s indices: the first maximum, as argmax's, at a fraction of its cost on CPU (96 x 49152 bf16
        # logits, 2 threads of an AMX Xeon: 1.7 vs 7.6 ms a step)
        return logits.max(-1).indices.tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    idx = inverse_cdf_rows(probs, _uniforms(rows, probs.device))
    if top_p < 1.0:
        todo = torch.arange(len(rows), device=probs.device)
        while len(todo):
            px = probs[todo, idx[todo]]
            doubt = px <= 1.0 - top_p  # a more probable token is in every nucleus
            todo, px = todo[doubt], px[doubt]
            if not len(todo):
                break
            sub = probs[todo]
            above = torch.where(sub > px[:, None], sub, 0.0).sum(-1)
            todo = todo[above >= top_p]  # outside the nucleus: these rows draw again
            if len(todo):
                idx[todo] = inverse_cdf_rows(probs[todo], _uniforms([rows[i] for i in todo.tolist()], probs.device))
    return idx.tolist()
