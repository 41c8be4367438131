"""Decoding metrics: one definition each (docs/methods.md section 11), imported wherever reported.

Conventions:
  * A "target forward" is one forward of the target that emits tokens. Our
    decoder fuses the prompt into the first step's forward, so plain decoding
    makes exactly one target forward per emitted token and its tau is 1.00
    (Hugging Face's prompt forward also emits the first token and is counted
    likewise). A separate prefill forward that emits nothing (head drafters
    need the target's hidden state before their first draft) is NOT counted.
  * tau = tokens emitted / target forwards, the final (bonus or residual)
    token of every step included.
  * Per-position acceptance at depth i = P(depth i accepted | depth i-1
    accepted and a candidate at depth i was tested), counted over steps.
  * Draft acceptance rate = accepted draft tokens / drafted tokens, over all
    steps (for a chain of K: the share of the K drafts kept; a tree's
    drafted tokens are all its nodes, so a tree's rate reads lower).
  * Accepted histogram: entry k = the number of steps that accepted k drafts.
  * Speedup = tokens/s of a method / tokens/s of a named baseline, same
    prompts, same machine, measured interleaved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


@dataclass
class StepStats:
    """One decoding step (one target forward)."""

    emitted: int  # tokens emitted this step (accepted drafts + final token, EOS-truncated)
    accepted: int  # draft tokens accepted
    attempted: int  # depths at which a candidate was tested along the accepted path
    drafted: int  # draft tokens in the tree (chain length for chains)
    draft_s: float
    verify_s: float
    other_s: float
    target_forwards: int = 1
    rows: int = 0  # rows of the target forward (uncached committed tokens + root + drafted nodes); 0: not recorded
    context: int = 0  # cached entries the forward attended to


@dataclass
class DecodeResult:
    """Output of one generation: new tokens and per-step statistics."""

    tokens: list[int]  # new tokens only (EOS included when reached)
    prompt_len: int
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0  # the whole call: prefill + decoding
    stop_reason: str = "max_new_tokens"  # or "eos"
    counted_forwards: int | None = None  # external decoders (HF): forward calls counted by a hook

    @property
    def target_forwards(self) -> int:
        if self.counted_forwards is not None:
            return self.counted_forwards
        return sum(s.target_forwards for s in self.steps)

    @property
    def tau(self) -> float:
        return tau(len(self.tokens), self.target_forwards)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tau"] = self.tau
        d["target_forwards"] = self.target_forwards
        return d


def tau(tokens_emitted: int, target_forwards: int) -> float:
    """Mean tokens per target forward (final token included; plain decoding = 1.00; see the module docstring)."""
    return tokens_emitted / target_forwards if target_forwards else 0.0


def acceptance_by_position(results: Iterable[DecodeResult], max_depth: int | None = None) -> list[float | None]:
    """[P(depth 1 accepted | tested), P(depth 2 accepted | depth 1 accepted, tested), ...].

    None where no step tested that depth.
    """
    steps = [s for r in results for s in r.steps]
    deepest = max([s.attempted for s in steps] + [0])
    if max_depth is not None:
        deepest = min(deepest, max_depth)
    out: list[float | None] = []
    for i in range(1, deepest + 1):
        tested = sum(1 for s in steps if s.attempted >= i)
        acc = sum(1 for s in steps if s.accepted >= i)
        out.append(acc / tested if tested else None)
    return out


def accepted_histogram(steps: Iterable[StepStats]) -> list[int]:
    """Steps by the number of drafts they accepted: entry k counts the steps that accepted k."""
    counts: list[int] = []
    for s in steps:
        if s.accepted >= len(counts):
            counts += [0] * (s.accepted + 1 - len(counts))
        counts[s.accepted] += 1
    return counts


def time_shares(results: Iterable[DecodeResult]) -> dict[str, float]:
    """Fractions of decoding time (prefill excluded) spent drafting, verifying, and elsewhere."""
    steps = [s for r in results for s in r.steps]
    d = sum(s.draft_s for s in steps)
    v = sum(s.verify_s for s in steps)
    o = sum(s.other_s for s in steps)
    tot = d + v + o
    if tot <= 0:
        return {"draft": 0.0, "verify": 0.0, "other": 0.0}
    return {"draft": d / tot, "verify": v / tot, "other": o / tot}


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Emitted tokens per wall-clock second (prefill time included in ``seconds`` by our callers)."""
    return tokens / seconds if seconds > 0 else 0.0


def speedup(method_tps: float, baseline_tps: float, baseline: str) -> dict:
    """Speedup over a named baseline; always reported with the baseline's name."""
    return {"speedup": method_tps / baseline_tps if baseline_tps > 0 else 0.0, "baseline": baseline}


def summarize(results: Sequence[DecodeResult]) -> dict:
    """Every figure for one method over a set of prompts."""
    tokens = sum(len(r.tokens) for r in results)
    fwd = sum(r.target_forwards for r in results)
    wall = sum(r.wall_s for r in results)
    steps = [st for r in results for st in r.steps]
    drafted = sum(st.drafted for st in steps)
    accepted = sum(st.accepted for st in steps)
    return {
        "prompts": len(results), "tokens": tokens, "target_forwards": fwd, "tau": tau(tokens, fwd),
        # draft tokens per step, and drafted tokens that verification threw away per accepted one
        "mean_draft_len": drafted / len(steps) if steps else 0.0,
        "wasted_per_accepted": (drafted - accepted) / accepted if accepted else None,
        "acceptance_rate": accepted / drafted if drafted else None, "accepted_hist": accepted_histogram(steps),
        "acceptance_by_position": acceptance_by_position(results), "time_shares": time_shares(results),
        "wall_s": wall, "tokens_per_s": tokens_per_second(tokens, wall),
        # mean milliseconds per step: what a step-time breakdown compares (e.g. verification depth)
        "step_ms": {k: 1e3 * sum(getattr(st, f"{k}_s") for st in steps) / len(steps) if steps else 0.0
                    for k in ("draft", "verify", "other")},
    }
