"""Per-request logits processors (penalties, logit bias) and the log-probabilities of emitted tokens.

A processor changes the target's logits at a position as a function of the
tokens before it, so in a draft/verify step the distribution at tree node
``n`` is computed from the committed tokens (prompt + emitted, root included)
followed by the drafted tokens on the path from the root to ``n``: exactly the
context plain decoding would have at that position. Verification then uses
the processed target distribution (p), and the draft's logits at node ``n``
get the same processing before q is formed, so the drafter proposes what the
processed target would (acceptance does not collapse). Losslessness only
needs p to be exact; q can be anything it was drawn from.

Processing, in order, on the raw logits (before temperature, top-k, top-p):
  1. repetition penalty r (HF / vLLM / CTRL): every token id present in the
     prompt or the output so far has its logit divided by r when positive,
     multiplied by r otherwise;
  2. frequency penalty f and presence penalty a (OpenAI): a token that occurs
     c times in the output so far (the prompt not included) loses f * c + a * [c > 0];
  3. logit bias: a fixed value added to the logit of each listed token id.

Log-probabilities (``top_logprobs``): for every emitted token, the log-softmax
of the target's processed logits (steps 1-3, before temperature / top-k /
top-p) at the position the token was emitted from, and the ``top_logprobs``
most probable tokens there. Verification already computes these logits;
recording them costs one log-softmax per emitted token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class Penalties:
    """The output-changing settings of one request. Defaults change nothing."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not self.repetition > 0:
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition}")

    @property
    def active(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.logit_bias)


@dataclass
class TokenLogprob:
    """One emitted token: its log-probability and the most probable alternatives (token id, logprob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class RequestProcessing:
    """One request's logits processing (stateless: a function of the context) and its logprob recorder.

    ``top_logprobs``: None records nothing; an int >= 0 records each emitted token's logprob and that many
    alternatives. The decoders call `node_logits` for every block of logits they sample or verify from and
    `record` after each verification walk.
    """

    def __init__(self, penalties: Penalties | None = None, vocab_size: int | None = None,
                 top_logprobs: int | None = None, process_draft: bool = True):
        self.penalties = penalties or Penalties()
        self.top_logprobs = top_logprobs
        # False: the draft's logits are left raw (only to measure what processing the draft buys; still lossless)
        self.process_draft = process_draft
        self.logprobs: list[TokenLogprob] = []
        if vocab_size is not None:
            bad = [t for t, _ in self.penalties.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary (0..{vocab_size - 1})")

    @property
    def active(self) -> bool:
        return self.penalties.active

    # -------------------------------------------------------------- the processors
    def apply(self, logits: torch.Tensor, out_counts: torch.Tensor, all_counts: torch.Tensor) -> torch.Tensor:
        """Processed logits [..., V] given per-row counts of each token in the output so far ([..., V]) and in
        prompt + output ([..., V])."""
        x = logits if logits.dtype == torch.float64 else logits.float()
        pen = self.penalties
        if pen.repetition != 1.0:
            seen = all_counts > 0
            x = torch.where(seen, torch.where(x > 0, x / pen.repetition, x * pen.repetition), x)
        if pen.frequency:
            x = x - pen.frequency * out_counts.to(x.dtype)
        if pen.presence:
            x = x - pen.presence * (out_counts > 0).to(x.dtype)
        if pen.logit_bias:
            ids = torch.tensor([t for t, _ in pen.logit_bias], device=x.device)
            vals = torch.tensor([v for _, v in pen.logit_bias], dtype=x.dtype, device=x.device)
            x = x.clone() if x is logits else x
            x[..., ids] += vals
        return x

    def logits_for(self, context: Sequence[int], prompt_len: int, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits [V] at the position after ``context`` (prompt + output): the reference
        definition, also used by the tests' target distributions."""
        if not self.active:
            return logits
        V = logits.shape[-1]
        dev = logits.device
        out = torch.bincount(torch.tensor(list(context[prompt_len:]), dtype=torch.long, device=dev), minlength=V)
        every = torch.bincount(torch.tensor(list(context), dtype=torch.long, device=dev), minlength=V)
        return self.apply(logits, out, every)

    def node_logits(self, tokens: Sequence[int], prompt_len: int, tree, start: int, end: int,
                    logits: torch.Tensor) -> torch.Tensor:
        """Processed logits [end - start, V] at tree nodes start..end-1; ``tokens``: the committed tokens and
        the root (prompt + output so far), each node adding the drafted tokens on its path from the root."""
        if not self.active:
            return logits
        V = logits.shape[-1]
        dev = logits.device
        toks, _ = tree.host_tokens()
        base_out = torch.bincount(torch.tensor(list(tokens[prompt_len:]), dtype=torch.long), minlength=V)
        base_all = base_out + torch.bincount(torch.tensor(list(tokens[:prompt_len]), dtype=torch.long), minlength=V)
        m = end - start
        extra = torch.zeros(m, V, dtype=torch.long)
        for j, n in enumerate(range(start, end)):
            for i in tree.path(n)[1:]:
                extra[j, toks[i]] += 1
        out = (base_out[None] + extra).to(dev)
        every = (base_all[None] + extra).to(dev)
        return self.apply(logits, out, every)

    # -------------------------------------------------------------- logprobs
    @property
    def recording(self) -> bool:
        return self.top_logprobs is not None

    def record(self, tree, logits: torch.Tensor, verdict) -> None:
        """Log-probabilities of a verdict's emitted tokens: token j was emitted from node ``verdict.path[j]``
        (``logits``: the processed target logits [n+1, V] of the walk)."""
        if not self.recording:
            return
        nodes = verdict.path[: len(verdict.tokens)]
        lp = torch.log_softmax(logits[nodes].double(), dim=-1)
        chosen = lp[torch.arange(len(nodes)), torch.tensor(verdict.tokens)].tolist()
        k = min(self.top_logprobs, lp.shape[-1])
        if k:
            top = torch.topk(lp, k, dim=-1)
            tv, ti = top.values.tolist(), top.indices.tolist()
        for j, (t, c) in enumerate(zip(verdict.tokens, chosen)):
            self.logprobs.append(TokenLogprob(int(t), float(c), list(zip(ti[j], tv[j])) if k else []))
