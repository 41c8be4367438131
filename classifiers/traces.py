"""Acceptance traces: what a chain drafter proposed, what it looked like, and whether the target took it.

`TraceRecorder` wraps any length policy (by default `FixedLength(K)`) and uses the
decoder's optional policy hooks (engine/policies.py): ``stop_after`` sees every
drafted token with the signal it was drawn from, ``observe`` sees the verdict and
the target's logits at every node. One row per drafted token d_i:

  * features (classifiers/features.py): position i, top1, top2, entropy of the
    distribution d_i came from, q_token = its probability, log_cum_prev and
    cum_q, ``hidden`` = the drafter state that produced d_i (fp16; absent for
    drafters without one); the state after consuming d_i is the next row's
    ``hidden`` in the same round (SpecDec++ reads it there);
  * labels: ``ratio`` = min(1, p(d_i) / q(d_i)) with p the target's distribution
    at d_i's position given the drafted prefix d_1..d_{i-1} and q the draft's, both
    after temperature/top-k/top-p exactly as verification uses them (greedy: both
    one-hot, so ratio is 1 iff d_i is the target's argmax). Teacher-forced on the
    drafted prefix, ratio IS P(d_i accepted | d_1..d_{i-1} accepted), for every row;
    ``accepted`` = what verification did and ``prefix_accepted`` = whether it got to
    test d_i at all (accepted is meaningful only where prefix_accepted is true).

Traces are recorded on TRAINING prompts (the recipe's data/train.jsonl first user
turns), never on MT-Bench, and stored as a Hugging Face `datasets.DatasetDict`
(``train`` / ``calibration``: every ``calibration_every``-th prompt, whole prompts,
so rounds never straddle the split) with ``meta.json`` (target fingerprint, drafter
identity, sampling, measured step costs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from draftsmith.checkpoint import read_json
from draftsmith.classifiers.features import distribution_features, last_row, safe_log
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import DraftSignal, FixedLength, LengthPolicy
from draftsmith.engine.sampling import SamplingParams, processed_probs
from draftsmith.engine.tree_build import measure_step_cost
from draftsmith.target import Target

log = logging.getLogger(__name__)

DATASET_DIR = "dataset"
META = "meta.json"


class TraceError(ValueError):
    """A trace set that cannot train or tune a predictor (empty, one class, wrong drafter or target)."""


# ---------------------------------------------------------------------------- identity
def drafter_identity(drafter: Any, checkpoint: str | Path | None = None) -> dict:
    """Who drafted: the name and, for a checkpoint, the sha256 of its weights file (a predictor is
    only valid for the drafter whose states and distributions it was trained on)."""
    ident = {"name": getattr(drafter, "name", type(drafter).__name__), "checkpoint": None, "weights_sha256": None}
    if checkpoint is not None:
        p = Path(checkpoint)
        ident["checkpoint"] = str(p)
        w = p / "model.safetensors"
        if w.is_file():
            h = hashlib.sha256()
            with open(w, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            ident["weights_sha256"] = h.hexdigest()
    return ident


def check_same_drafter(made_for: dict, drafter: dict, what: str) -> None:
    """`TraceError` unless ``drafter`` is the drafter ``made_for`` describes (weights hash, else name)."""
    a, b = made_for.get("weights_sha256"), drafter.get("weights_sha256")
    same = a == b if (a or b) else made_for.get("name") == drafter.get("name")
    if not same:
        raise TraceError(f"{what} was made for drafter {made_for.get('name')!r} "
                         f"({made_for.get('checkpoint') or 'no checkpoint'}, weights {str(a)[:12]}), not for "
                         f"{drafter.get('name')!r} ({drafter.get('checkpoint') or 'no checkpoint'}, weights "
                         f"{str(b)[:12]}): record traces and train a predictor for this drafter")


# ---------------------------------------------------------------------------- recording
@dataclass
class _Round:
    rows: list[dict] = field(default_factory=list)
    cum_log: float = 0.0


class TraceRecorder:
    """A length policy that defers every decision to ``inner`` and records each drafted token.

    Chains only (the decoder calls ``observe`` for chains). ``prompt`` and ``temperature``
    are stamped on the rows; set ``prompt`` before each generation.
    """

    def __init__(self, inner: LengthPolicy, sampling: SamplingParams):
        self.inner, self.sampling = inner, sampling
        self.rows: list[dict] = []
        self.steps: list[dict] = []
        self.prompt = 0
        self._round = _Round()
        self._step = 0
        self._inner_stop = getattr(inner, "stop_after", None)
        self._inner_observe = getattr(inner, "observe", None)

    @property
    def max_len(self) -> int:
        return self.inner.max_len

    def reset(self) -> None:
        self._round, self._step = _Round(), 0
        r = getattr(self.inner, "reset", None)
        if r is not None:
            r()

    def should_continue(self, signal: DraftSignal) -> bool:
        return self.inner.should_continue(signal)

    def stop_after(self, signal: DraftSignal, token) -> bool:
        tok = int(token)
        probs = signal.probs
        top1, top2, ent = distribution_features(probs)
        q_tok = float(probs[tok])
        r = self._round
        h = last_row(signal.features)
        r.rows.append({"position": signal.depth + 1, "token": tok, "top1": top1, "top2": top2, "entropy": ent,
                       "q_token": q_tok, "log_cum_prev": r.cum_log, "cum_q": math.exp(r.cum_log) * q_tok,
                       "hidden": None if h is None else h.detach().float().cpu().numpy().astype(np.float16),
                       "_q": None if signal.q is None else float(signal.q[tok])})
        r.cum_log += safe_log(q_tok)
        return bool(self._inner_stop(signal, token)) if self._inner_stop is not None else False

    def observe(self, state, tree, verdict, logits: torch.Tensor) -> None:
        r = self._round
        if len(r.rows) != tree.n:
            raise RuntimeError(f"trace recorder saw {len(r.rows)} drafted tokens, the tree holds {tree.n}")
        if tree.n:
            s = self.sampling
            p = processed_probs(logits[: tree.n], s.temperature, s.top_k, s.top_p)  # row i-1: p for node i
            toks = torch.tensor([row["token"] for row in r.rows], device=p.device)
            p_tok = p.gather(1, toks[:, None])[:, 0].double().tolist()
            for i, row in enumerate(r.rows, 1):
                q = row.pop("_q")
                q = 1.0 if q is None else q  # greedy: q is one-hot at the drafted argmax
                row.update(ratio=min(1.0, p_tok[i - 1] / q) if q > 0 else 0.0,
                           accepted=i <= verdict.accepted, prefix_accepted=i <= verdict.accepted + 1,
                           prompt=self.prompt, step=self._step, temperature=s.temperature)
                self.rows.append(row)
        self.steps.append({"drafted": tree.n, "accepted": verdict.accepted})
        self._step += 1
        self._round = _Round()
        if self._inner_observe is not None:
            self._inner_observe(state, tree, verdict, logits)


def record(target: Target, drafter: Any, prompts: Iterable[list[int]], sampling: SamplingParams, *,
           draft_len: int = 8, max_new_tokens: int = 128, seed: int = 0, policy: LengthPolicy | None = None,
           progress=None) -> tuple[list[dict], list[dict]]:
    """Decode ``prompts`` with the real decoder and ``drafter`` (chains), recording every drafted token.
    Returns (rows, per-step stats with timings)."""
    rec = TraceRecorder(policy or FixedLength(draft_len), sampling)
    dec = SpeculativeDecoder(target, drafter, policy=rec, sampling=sampling)
    steps = []
    for k, ids in enumerate(prompts):
        rec.prompt = k
        res = dec.generate(ids, max_new_tokens, seed=seed + k)
        steps += [{"drafted": st.drafted, "draft_s": st.draft_s, "verify_s": st.verify_s} for st in res.steps]
        if progress:
            progress(k, res)
    return rec.rows, steps


def cost_model(target: Target, steps: list[dict], max_len: int) -> dict:
    """Step cost of a round with n drafts, relative to a 1-row target forward, on this machine:
    ``verify[n]`` measured by `measure_step_cost`, ``draft_per_forward`` from the recorded draft times."""
    rel = measure_step_cost(target, list(range(1, max_len + 1)), repeats=5)
    verify = [1.0] + [float(rel[str(n)]) for n in range(1, max_len + 1)]
    full = [s for s in steps if s["drafted"] > 0]
    if not full:
        return {"verify": verify, "draft_per_forward": 0.0, "one_row_s": None}
    # a 1-row forward's time, estimated from this run's verification times and their relative costs
    one_row = float(np.median([s["verify_s"] / verify[min(s["drafted"], max_len)] for s in full]))
    per_fwd = float(np.median([s["draft_s"] / s["drafted"] for s in full]))
    return {"verify": verify, "draft_per_forward": per_fwd / one_row if one_row > 0 else 0.0, "one_row_s": one_row}


# ---------------------------------------------------------------------------- storage
def _columns(rows: list[dict]) -> dict:
    keys = ["prompt", "step", "temperature", "position", "token", "top1", "top2", "entropy", "q_token",
            "log_cum_prev", "cum_q", "ratio", "accepted", "prefix_accepted"]
    cols = {k: [r[k] for r in rows] for k in keys}
    if rows and rows[0]["hidden"] is not None:
        cols["hidden"] = [r["hidden"] for r in rows]
    return cols


def save_traces(out: str | Path, rows: list[dict], meta: dict, calibration_every: int = 5) -> Path:
    """Write ``out/dataset`` (DatasetDict train/calibration, split by prompt) and ``out/meta.json``."""
    from datasets import Dataset, DatasetDict  # heavy import, only for writing

    if not rows:
        raise TraceError("no drafted tokens were recorded: nothing to save (did every prompt stop at once?)")
    if calibration_every < 2:
        raise ValueError(f"calibration_every must be >= 2, got {calibration_every}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cal = [r for r in rows if r["prompt"] % calibration_every == calibration_every - 1]
    tr = [r for r in rows if r["prompt"] % calibration_every != calibration_every - 1]
    DatasetDict({"train": Dataset.from_dict(_columns(tr)), "calibration": Dataset.from_dict(_columns(cal))}
                ).save_to_disk(str(out / DATASET_DIR))
    meta = {**meta, "rows": {"train": len(tr), "calibration": len(cal)}, "calibration_every": calibration_every}
    (out / META).write_text(json.dumps(meta, indent=2))
    return out


@dataclass
class Traces:
    """One split of a trace set as numpy columns, plus the set's meta."""

    columns: dict[str, np.ndarray]
    meta: dict
    split: str

    def __len__(self) -> int:
        return len(self.columns["ratio"])

    def rounds(self) -> list[np.ndarray]:
        """Row indices of each round (one verification step), in position order."""
        key = self.columns["prompt"].astype(np.int64) * 1_000_003 + self.columns["step"].astype(np.int64)
        key = key + (self.columns["temperature"] * 1e9).astype(np.int64) * 7
        order = np.lexsort((self.columns["position"], key))
        k = key[order]
        cuts = np.flatnonzero(np.diff(k)) + 1
        return np.split(order, cuts)

    def at_temperature(self, temperature: float) -> "Traces":
        keep = np.isclose(self.columns["temperature"], temperature)
        if not keep.any():
            have = sorted({float(t) for t in self.columns["temperature"]})
            raise TraceError(f"no {self.split} trace rows at temperature {temperature} (recorded: {have})")
        return Traces({k: v[keep] for k, v in self.columns.items()}, self.meta, self.split)

    def check_trainable(self, what: str) -> None:
        """`TraceError` for an empty or one-class set (nothing to learn or tune)."""
        n = len(self)
        if n == 0:
            raise TraceError(f"{what}: the {self.split} split holds no trace rows")
        y = self.columns["ratio"]
        if (y >= 1.0).all() or (y <= 0.0).all():
            cls = "accepted" if (y >= 1.0).all() else "rejected"
            raise TraceError(f"{what}: all {n} {self.split} rows are {cls} (one class): a predictor cannot "
                             f"learn from it; record more or longer drafts")


def load_traces(path: str | Path, split: str) -> Traces:
    """A split (``train`` or ``calibration``) of a trace directory written by `save_traces`."""
    from datasets import load_from_disk  # heavy import, only for reading

    path = Path(path)
    meta = read_json(path / META, "acceptance-trace meta", required=("target.fingerprint", "drafter"))
    if not (path / DATASET_DIR).is_dir():
        raise TraceError(f"{path / DATASET_DIR}: missing (acceptance traces); run `draftsmith traces` first")
    dd = load_from_disk(str(path / DATASET_DIR))
    if split not in dd:
        raise TraceError(f"{path}: no {split!r} split (have {list(dd)})")
    ds = dd[split].with_format("numpy")
    cols = {k: np.asarray(ds[k]) for k in ds.column_names} if len(ds) else {
        k: np.zeros(0) for k in ("prompt", "step", "temperature", "position", "ratio")}
    return Traces(cols, meta, split)


def describe(rows: list[dict]) -> dict:
    """Headline figures of a row list (for the log and meta)."""
    if not rows:
        return {"rows": 0}
    r = np.array([x["ratio"] for x in rows])
    tested = [x for x in rows if x["prefix_accepted"]]
    return {"rows": len(rows), "mean_ratio": float(r.mean()),
            "acceptance_when_tested": float(np.mean([x["accepted"] for x in tested])) if tested else None}


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
