"""Cost profiles: what a target forward and a drafter pass cost on one machine, in seconds.

A profile is a YAML file (schema `Profile`) holding

  * ``forward``: the target's forward time as a table over ``rows`` (rows in the forward: uncached
    committed tokens + the root + drafted nodes; a batched step sums them over its sequences) and
    ``contexts`` (cached entries attended to); read by linear interpolation in both, never
    extrapolated past the largest row count (a shape the profile lacks is an error, `ProfileError`);
  * ``overhead``: host work per step (sampling, acceptance, cache compaction, Python), per drafted
    node, and per extra sequence of a batched step;
  * ``drafters``: per drafter, a step's drafting time = ``step_s + pass_s * passes + node_s * nodes``
    (passes: drafter forwards, i.e. the chain's length or the tree's depth; nodes: drafted tokens);
  * where the numbers come from (``source``) and what is assumed (``assumptions``): measured here by
    ``draftsmith simulate calibrate``, or, for hardware we do not have, built from published latencies
    with the row scaling stated as an assumption.

Built-in profiles live in draftsmith/sim/profiles/ (`builtin_profiles`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from draftsmith.schema import StrictModel

PROFILES = Path(__file__).parent / "profiles"


class ProfileError(ValueError):
    """A profile that cannot price a step: malformed, a non-positive cost, or a shape it does not hold."""


class ForwardTable(StrictModel):
    rows: list[int]
    contexts: list[int]
    seconds: list[list[float]]  # [len(contexts)][len(rows)]
    # the LM head's time over r rows, on the same rows grid; when given, ``seconds`` is the body only (a
    # prefill projects no row, a verification only its drafted rows and root); when absent, ``seconds``
    # is the whole forward with every row projected
    head_seconds: list[float] | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ForwardTable":
        if not self.rows or not self.contexts:
            raise ValueError("forward.rows and forward.contexts must not be empty")
        for name, xs, low in (("rows", self.rows, 1), ("contexts", self.contexts, 0)):
            if any(x < low for x in xs) or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"forward.{name} must be increasing integers >= {low}, got {xs}")
        if self.head_seconds is not None and (len(self.head_seconds) != len(self.rows) or any(
                not (t > 0 and np.isfinite(t)) for t in self.head_seconds)):
            raise ValueError(f"forward.head_seconds must be {len(self.rows)} positive times (one per row count)")
        if len(self.seconds) != len(self.contexts) or any(len(r) != len(self.rows) for r in self.seconds):
            raise ValueError(f"forward.seconds must be {len(self.contexts)} lists (one per context) of "
                             f"{len(self.rows)} times (one per row count)")
        bad = [(c, r, t) for c, ts in zip(self.contexts, self.seconds) for r, t in zip(self.rows, ts)
               if not (t > 0 and np.isfinite(t))]
        if bad:
            c, r, t = bad[0]
            raise ValueError(f"forward.seconds must be positive and finite: {t} at rows={r}, context={c} "
                             f"({len(bad)} such entries)")
        return self


class Overhead(StrictModel):
    step_s: float = Field(0.0, ge=0)  # every step
    node_s: float = Field(0.0, ge=0)  # per drafted node (acceptance walk, cache compaction)
    sequence_s: float = Field(0.0, ge=0)  # per extra sequence in a batched step
    batch_step_s: float = Field(0.0, ge=0)  # per step of the batched decoder, on top of step_s


class DrafterCost(StrictModel):
    pass_s: float  # one drafter forward (one depth level)
    step_s: float = Field(0.0, ge=0)  # fixed per drafting step (e.g. feeding the accepted tokens)
    node_s: float = Field(0.0, ge=0)  # per drafted node (sampling, tree bookkeeping)
    source: str = ""

    @field_validator("pass_s")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not (v > 0 and np.isfinite(v)):
            raise ValueError(f"pass_s must be a positive time in seconds, got {v}")
        return v


class Profile(StrictModel):
    name: str
    hardware: str
    source: str  # where the forward times come from (a command, or a paper and table)
    assumptions: list[str] = []
    target: dict = {}  # name, and the fingerprint when measured on this target
    forward: ForwardTable
    overhead: Overhead = Overhead()
    drafters: dict[str, DrafterCost] = {}

    # ------------------------------------------------------------------ pricing
    def forward_s(self, rows: int, context: int = 0, logits: int | None = None) -> float:
        """Seconds of one target forward over ``rows`` rows after ``context`` cached entries, ``logits`` of
        them projected by the LM head (default: all)."""
        f = self.forward
        logits = rows if logits is None else logits
        if not 0 <= logits <= rows:
            raise ProfileError(f"a forward over {rows} rows cannot project {logits} of them")
        if rows < 1:
            raise ProfileError(f"a forward has at least one row, got {rows}")
        if rows > f.rows[-1]:
            raise ProfileError(f"profile {self.name!r} has no forward time for {rows} rows (its table stops at "
                               f"{f.rows[-1]} rows): measure or give a table that reaches it")
        if rows < f.rows[0]:
            raise ProfileError(f"profile {self.name!r} has no forward time for {rows} rows (its table starts at "
                               f"{f.rows[0]} rows)")
        per_ctx = [float(np.interp(rows, f.rows, ts)) for ts in f.seconds]
        # contexts beyond the table are clamped: attention over the cache is a small share of a step here
        t = float(np.interp(context, f.contexts, per_ctx))
        if f.head_seconds is not None and logits > 0:
            t += float(np.interp(logits, f.rows, f.head_seconds))
        return t

    def drafter(self, name: str) -> DrafterCost:
        if name not in self.drafters:
            raise ProfileError(f"profile {self.name!r} has no cost for drafter {name!r} (it has "
                               f"{sorted(self.drafters) or 'none'}): calibrate with that drafter")
        return self.drafters[name]

    def draft_s(self, drafter: str, passes: int, nodes: int) -> float:
        if nodes <= 0:
            return 0.0
        d = self.drafter(drafter)
        return d.step_s + d.pass_s * passes + d.node_s * nodes

    def relative_cost(self, drafter: str, max_len: int, context: int = 256) -> dict:
        """The step-cost dict the trace tuners use (classifiers/tuning.py): ``verify[n]`` = a forward over
        n drafts + the root relative to a 1-row forward, ``draft_per_forward`` = one drafter pass in the
        same unit."""
        one = self.forward_s(1, context) + self.overhead.step_s
        verify = [1.0] + [(self.forward_s(n + 1, context) + self.overhead.step_s + self.overhead.node_s * n) / one
                          for n in range(1, max_len + 1)]
        return {"verify": verify, "draft_per_forward": self.drafter(drafter).pass_s / one, "one_row_s": one,
                "profile": self.name}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False, width=120)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path


def builtin_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PROFILES.glob("*.yaml"))}


def load_profile(spec: str | Path) -> Profile:
    """A profile from a YAML path or a built-in name; `ProfileError` naming what is wrong."""
    path = Path(spec)
    if not path.is_file():
        known = builtin_profiles()
        if str(spec) not in known:
            raise ProfileError(f"{spec}: no such profile file, and not a built-in profile ({sorted(known)})")
        path = known[str(spec)]
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a YAML mapping, got {type(data).__name__}")
    try:
        return Profile(**data)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'profile'}: {err['msg']}" for err in e.errors())
        raise ProfileError(f"{path}: invalid profile: {msgs}") from None
