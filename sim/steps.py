"""Step traces: what every decoding step of a real run did, and its time under a cost profile.

A step trace (JSON, ``format: draftsmith-step-trace/1``) records, for each generation of a run made by
our decoder (`SpeculativeDecoder` or `BatchedSpeculativeDecoder`), every step's shape: the rows of its
target forward and the cached context, the drafted nodes and drafter passes, the accepted drafts and the
emitted tokens; plus the prefill forward where one ran (head drafters read the target's state before
their first draft), the measured wall time, and who made it (target name and fingerprint, vocabulary,
tokenizer, drafter). Replaying it under a `Profile` prices each event:

    step  = forward_s(rows, context) + overhead.step_s + overhead.node_s * nodes
            + [drafting] drafter.step_s + drafter.pass_s * passes + drafter.node_s * nodes
    batch = the same over the summed rows of all live sequences,
            + overhead.batch_step_s + overhead.sequence_s * (live - 1)

and the tokens are the trace's own, so simulated tokens/s = tokens / (prefill + sum of steps). The
decisions (how many drafts, how many accepted) are replayed as recorded: this is how a measured run
would have timed on the profile's hardware, not a new decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from draftsmith.sim.profile import Profile

FORMAT = "draftsmith-step-trace/1"
MODES = ("plain", "chain", "tree", "batched")


class StepTraceError(ValueError):
    """A step trace that cannot be replayed here: malformed, or made for another target or tokenizer."""


@dataclass
class Step:
    rows: int  # rows of the target forward
    context: int  # cached entries attended to (a batched step: the mean over its sequences)
    nodes: int  # drafted tokens (all sequences of a batched step)
    passes: int  # drafter forwards (chain length or tree depth; 0: no drafting)
    accepted: int
    emitted: int
    live: int = 1  # sequences in the forward

    def to_list(self) -> list[int]:
        return [self.rows, self.context, self.nodes, self.passes, self.accepted, self.emitted, self.live]


@dataclass
class Run:
    """One generation (or one batched generation of several prompts)."""

    steps: list[Step]
    prefill_rows: list[int]  # one separate prefill forward per sequence (empty: fused into the first step)
    tokens: int
    wall_s: float | None = None  # measured, when the run was timed
    step_s: list[float] | None = None  # measured seconds of each step (diagnostics)
    prefill_s: float | None = None  # measured seconds before the first step
    cpu_s: float | None = None  # measured CPU seconds of the run (one torch thread), where timed so

    def to_dict(self) -> dict:
        return {"steps": [s.to_list() for s in self.steps], "prefill_rows": self.prefill_rows, "tokens": self.tokens,
                "wall_s": self.wall_s, "step_s": self.step_s, "prefill_s": self.prefill_s, "cpu_s": self.cpu_s}

    @classmethod
    def from_dict(cls, d: dict) -> "Run":
        return cls([Step(*row) for row in d["steps"]], list(d["prefill_rows"]), int(d["tokens"]), d.get("wall_s"),
                   d.get("step_s"), d.get("prefill_s"), d.get("cpu_s"))


@dataclass
class StepTrace:
    mode: str
    target: dict  # name, fingerprint, vocab_size, tokenizer
    drafter: str | None
    runs: list[Run] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise StepTraceError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "plain" and not self.drafter:
            raise StepTraceError(f"a {self.mode} trace names its drafter")

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.runs)

    @property
    def measured_s(self) -> float | None:
        ts = [r.wall_s for r in self.runs]
        return None if any(t is None for t in ts) else float(sum(ts))

    @property
    def measured_cpu_s(self) -> float | None:
        ts = [r.cpu_s for r in self.runs]
        return None if not ts or any(t is None for t in ts) else float(sum(ts))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "mode": self.mode, "target": self.target, "drafter": self.drafter,
                "meta": self.meta, "runs": [r.to_dict() for r in self.runs]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path


def target_identity(target) -> dict:
    tok = target.tokenizer
    return {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": int(target.vocab_size),
            "tokenizer": getattr(tok, "name_or_path", type(tok).__name__)}


def load_step_trace(path: str | Path) -> StepTrace:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StepTraceError(f"{path}: cannot read a step trace ({e})") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise StepTraceError(f"{path}: not a step trace (format {d.get('format') if isinstance(d, dict) else None!r}"
                             f", expected {FORMAT!r}); record one with `draftsmith simulate record`")
    try:
        runs = [Run.from_dict(r) for r in d["runs"]]
        tr = StepTrace(d["mode"], dict(d["target"]), d.get("drafter"), runs, d.get("meta", {}))
    except (KeyError, TypeError, ValueError) as e:
        raise StepTraceError(f"{path}: malformed step trace ({type(e).__name__}: {e})") from e
    for r in tr.runs:
        for s in r.steps:
            if s.rows < 1 or s.context < 0 or min(s.nodes, s.passes, s.accepted, s.emitted) < 0 or s.live < 1:
                raise StepTraceError(f"{path}: impossible step {s.to_list()} (rows >= 1, counts >= 0)")
    return tr


def check_trace_for(trace: StepTrace, expect: dict, what: str = "step trace") -> None:
    """`StepTraceError` unless ``trace`` was recorded with the target and tokenizer ``expect`` describes
    (a `target_identity` dict, or a measured profile's ``target`` section: only the keys both hold are
    compared; a published profile names its target only, and pricing one target's decisions at another's
    costs is the point of it)."""
    for key in ("fingerprint", "vocab_size", "tokenizer"):
        a, b = trace.target.get(key), expect.get(key)
        if a is not None and b is not None and a != b:
            raise StepTraceError(f"{what} was recorded with target {trace.target.get('name')!r} ({key} {a}), not "
                                 f"with {expect.get('name')!r} ({key} {b}): acceptance and step shapes belong to "
                                 f"one target and tokenizer; record a trace with this one")


# ---------------------------------------------------------------------------- recording from results
def from_results(results: Sequence[Any], *, mode: str, target_id: dict, drafter: str | None, probes_next: bool = False,
                 max_len: int | None = None, tree_depth: int | None = None, meta: dict | None = None) -> StepTrace:
    """A step trace from `DecodeResult` s (batch size 1) of one decoder.

    Drafter passes per step: a tree's depth (``tree_depth``); a chain's length, plus one when the
    policy looked at a candidate and declined it (``probes_next``: policies that decide in
    ``should_continue``, e.g. the confidence stop; the pass that produced the declined candidate ran)."""
    if mode == "batched":
        raise StepTraceError("batched runs: use from_batch_results")
    runs = []
    for r in results:
        steps = []
        for st in r.steps:
            if not st.rows:
                raise StepTraceError("these results carry no forward shapes (StepStats.rows = 0): decode with "
                                     "draftsmith's SpeculativeDecoder")
            if st.drafted == 0:
                passes = 0
            elif mode == "tree":
                passes = tree_depth or st.drafted
            else:  # near max_new_tokens a chain is cut short by the room left; counted as if by the policy
                probed = probes_next and max_len is not None and st.drafted < max_len
                passes = st.drafted + (1 if probed else 0)
            steps.append(Step(st.rows, st.context, st.drafted, passes, st.accepted, st.emitted))
        first = r.steps[0] if r.steps else None
        prefill = [first.context] if first is not None and first.context > 0 else []
        runs.append(Run(steps, prefill, len(r.tokens), r.wall_s,
                        [st.draft_s + st.verify_s + st.other_s for st in r.steps], r.prefill_s))
    return StepTrace(mode, target_id, drafter, runs, meta or {})


def from_batch_results(results: Sequence[Any], *, target_id: dict, drafter: str | None, tree_depth: int | None = None,
                       meta: dict | None = None) -> StepTrace:
    """A step trace from `BatchResult` s: one `Run` per batched generation; contexts are the mean over the
    live sequences (each sequence: its prompt + what it emitted so far)."""
    runs = []
    for b in results:
        ctx = {i: r.prompt_len for i, r in enumerate(b.rows)}
        live = [i for i, r in enumerate(b.rows) if r.steps]
        pos = {i: 0 for i in live}
        steps = []
        for bs in b.steps:
            cur = live[:]  # sequences stepping now (in this step's order does not matter for the sums)
            mean_ctx = round(sum(ctx[i] for i in cur) / len(cur))
            passes = 0 if bs.k == 0 else (tree_depth if tree_depth else bs.k)
            steps.append(Step(bs.drafted + bs.live, mean_ctx, bs.drafted, passes, bs.accepted, bs.emitted, bs.live))
            for i in cur:
                st = b.rows[i].steps[pos[i]]
                ctx[i] += st.emitted
                pos[i] += 1
            live = [i for i in cur if pos[i] < len(b.rows[i].steps)]
            if len(cur) != bs.live:
                raise StepTraceError(f"batched step with {bs.live} live rows, but {len(cur)} rows still had steps")
        prefill = [max(r.prompt_len - 1, 1) for r in b.rows if r.steps]
        runs.append(Run(steps, prefill, b.tokens, b.wall_s, [s.draft_s + s.verify_s + s.other_s for s in b.steps],
                        b.prefill_s))
    return StepTrace("batched", target_id, drafter, runs, meta or {})


# ---------------------------------------------------------------------------- pricing
def step_seconds(step: Step, profile: Profile, drafter: str | None, batched: bool = False) -> float:
    o = profile.overhead
    t = profile.forward_s(step.rows, step.context, min(step.rows, step.nodes + step.live)) + o.step_s
    t += o.node_s * step.nodes + (o.batch_step_s + o.sequence_s * (step.live - 1) if batched else 0.0)
    if step.nodes > 0:
        if drafter is None:
            raise StepTraceError("a step drafted tokens but the trace names no drafter")
        t += profile.draft_s(drafter, step.passes, step.nodes)
    return t


def simulate_trace(trace: StepTrace, profile: Profile, drafter: str | None = None) -> dict:
    """Simulated seconds and tokens/s of ``trace`` under ``profile`` (``drafter``: the profile's drafter entry
    to price drafting with; default the trace's drafter name). Also the measured figures where recorded."""
    who = drafter or trace.drafter
    prefill = sum(profile.forward_s(n, 0, 0) for r in trace.runs for n in r.prefill_rows)
    steps = sum(step_seconds(s, profile, who, trace.mode == "batched") for r in trace.runs for s in r.steps)
    total = prefill + steps
    n_steps = sum(len(r.steps) for r in trace.runs)
    out = {"mode": trace.mode, "tokens": trace.tokens, "steps": n_steps, "simulated_s": total,
           "simulated_tokens_per_s": trace.tokens / total if total > 0 else 0.0, "prefill_s": prefill,
           "profile": profile.name}
    meas = trace.measured_s
    if meas:
        out["measured_s"] = meas
        out["measured_tokens_per_s"] = trace.tokens / meas
        out["error"] = out["simulated_tokens_per_s"] / out["measured_tokens_per_s"] - 1.0
    cpu = trace.measured_cpu_s
    if cpu:
        out["measured_cpu_s"] = cpu
        out["measured_cpu_tokens_per_s"] = trace.tokens / cpu
        out["error_cpu"] = out["simulated_tokens_per_s"] / out["measured_cpu_tokens_per_s"] - 1.0
    return out
