"""DISCO (docs/methods.md section 6): a small classifier on draft-side features decides the draft length.

Before each candidate d_{k+1} is drafted, a logistic regression on the candidate's
draft-side features (classifiers/features.py: top1, top2, entropy, position,
log cumulative draft probability of the prefix) predicts
P(d_{k+1} accepted | d_1..d_k accepted); drafting stops when it falls below a
threshold tuned on the calibration split for expected tokens per unit of step cost
(classifiers/tuning.py). The paper's exact features are not confirmed (docs/methods.md);
these are the ones it is believed to use.

Training labels are the traces' ratio = min(1, p/q) (soft: each row is an accepted
example with weight ratio and a rejected one with weight 1 - ratio; greedy ratios
are 0/1). The fitted model is saved as JSON (standardisation, coefficients,
intercept, threshold: no pickle) and predicts with the same numpy formula
before and after a reload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from draftsmith.checkpoint import command_line, read_json
from draftsmith.classifiers.features import DISCO_FEATURES, distribution_features, safe_log
from draftsmith.classifiers.traces import TraceError, Traces, check_same_drafter
from draftsmith.classifiers.tuning import best_fixed, calibration_rounds, quality, tune_threshold_and_cap
from draftsmith.engine.policies import DraftSignal
from draftsmith.registry import register_predictor
from draftsmith.target import check_fingerprint

FORMAT = "draftsmith-disco/1"
FILE = "disco.json"
MODES = ("before", "after")  # stop before a doubtful candidate, or submit it and stop after it


@dataclass
class DiscoModel:
    """Standardised logistic regression: P = sigmoid(((x - mean) / scale) . coef + intercept)."""

    mean: list[float]
    scale: list[float]
    coef: list[float]
    intercept: float
    threshold: float = 0.5
    features: tuple[str, ...] = DISCO_FEATURES
    meta: dict = field(default_factory=dict)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """P(accepted) for rows x [n, F] (or one row [F])."""
        x = np.asarray(x, dtype=np.float64)
        z = ((x - np.asarray(self.mean)) / np.asarray(self.scale)) @ np.asarray(self.coef) + self.intercept
        return 1.0 / (1.0 + np.exp(-z))

    def to_json(self) -> dict:
        return {"format": FORMAT, "features": list(self.features), "mean": self.mean, "scale": self.scale,
                "coef": self.coef, "intercept": self.intercept, "threshold": self.threshold, **self.meta}

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / FILE).write_text(json.dumps(self.to_json(), indent=2))  # floats round-trip exactly (repr)
        return out / FILE


def feature_matrix(t: Traces, names=DISCO_FEATURES) -> np.ndarray:
    return np.stack([t.columns[n].astype(np.float64) for n in names], axis=1)


def fit(train: Traces, cal: Traces, *, max_len: int, min_len: int = 1, c: float = 1.0) -> DiscoModel:
    """Fit on the train split, tune the threshold and measure quality on the calibration split."""
    from sklearn.linear_model import LogisticRegression  # optional heavy dependency, only for fitting

    train.check_trainable("DISCO training")
    x, y = feature_matrix(train), train.columns["ratio"].astype(np.float64)
    mean, scale = x.mean(0), x.std(0)
    scale[scale == 0] = 1.0
    xs = (x - mean) / scale
    xx, yy = np.concatenate([xs, xs]), np.concatenate([np.ones(len(y)), np.zeros(len(y))])
    w = np.concatenate([y, 1.0 - y])
    keep = w > 0
    clf = LogisticRegression(C=c, max_iter=1000).fit(xx[keep], yy[keep], sample_weight=w[keep])
    model = DiscoModel([float(v) for v in mean], [float(v) for v in scale], [float(v) for v in clf.coef_[0]],
                       float(clf.intercept_[0]))
    rounds, ratio = calibration_rounds(cal)
    pred = model.predict(feature_matrix(cal))
    cost = cal.meta["cost"]
    k = min(max_len, int(cal.columns["position"].max()))

    def lengths(t: float, mode: str):
        out = []
        for idx in rounds:
            below = np.flatnonzero(pred[idx] < t)
            if mode == "before":  # stop before the candidate: its distribution's forward is already paid
                below = below[below >= min_len]
                n = int(below[0]) if len(below) else len(idx)
                out.append((n, n + 1 if n < len(idx) else n))
            else:  # "after": submit the doubtful candidate (a verification row, no drafter forward), then stop
                n = int(below[0]) + 1 if len(below) else len(idx)
                out.append((n, n))
        return out

    grid = np.unique(np.quantile(pred, np.linspace(0, 1, 101)))
    tuned = {m: tune_threshold_and_cap(lambda t, m=m: lengths(t, m), grid, rounds, ratio, cost, k) for m in MODES}
    mode = max(MODES, key=lambda m: tuned[m]["simulated"]["tokens_per_cost"])
    model.threshold = tuned[mode]["threshold"]
    model.meta = {"mode": mode, "calibration": {"quality": quality(pred, ratio), "tuning": tuned[mode],
                                                "tuning_other_mode": tuned[MODES[1 - MODES.index(mode)]],
                                                "fixed": best_fixed(rounds, ratio, cost, k)},
                  "train_rows": len(train), "max_len": max_len, "cap": tuned[mode]["cap"], "min_len": min_len,
                  "C": c}
    return model


def load(path: str | Path) -> DiscoModel:
    """A saved DISCO model (a directory holding disco.json, or the file); errors name the file."""
    p = Path(path)
    p = p / FILE if p.is_dir() else p
    d = read_json(p, "DISCO classifier", required=("format", "coef", "mean", "scale", "intercept", "threshold"))
    if d["format"] != FORMAT:
        raise TraceError(f"{p}: format {d['format']!r}, expected {FORMAT!r}")
    feats = tuple(d.get("features", DISCO_FEATURES))
    if feats != DISCO_FEATURES or not len(d["coef"]) == len(d["mean"]) == len(d["scale"]) == len(feats):
        raise TraceError(f"{p}: features {list(feats)} with {len(d['coef'])} coefficients do not match this "
                         f"version's {list(DISCO_FEATURES)}")
    meta = {k: v for k, v in d.items() if k not in ("format", "features", "mean", "scale", "coef", "intercept",
                                                     "threshold")}
    return DiscoModel(d["mean"], d["scale"], d["coef"], float(d["intercept"]), float(d["threshold"]), feats, meta)


def check_for(model: DiscoModel, target, drafter_ident: dict, temperature: float, what: str = "DISCO") -> None:
    """Clear errors when a model is used with another target, drafter or temperature than it was made for."""
    t = model.meta.get("target") or {}
    check_fingerprint(t.get("fingerprint", "?"), target, what=what)
    check_same_drafter(model.meta.get("drafter") or {}, drafter_ident, what)
    if not math.isclose(float(model.meta.get("temperature", temperature)), temperature):
        raise TraceError(f"{what} was tuned at temperature {model.meta.get('temperature')}, not {temperature}")


class DiscoStop:
    """Length policy on DISCO's P(candidate accepted | prefix accepted) versus its threshold.

    ``mode`` (default: the one tuned on the calibration split): "before" drafts the candidate
    only while P >= threshold (``min_len`` drafts always made); "after" drafts every candidate
    and stops right after one with P < threshold (its logits were already computed, so it costs
    a verification row and no drafter forward). At most ``max_len`` drafts. Costs one host sync
    and a 5-feature dot product per candidate.
    """

    def __init__(self, model: DiscoModel, max_len: int | None = None, min_len: int = 1,
                 threshold: float | None = None, mode: str | None = None):
        if max_len is None:  # the cap tuned with the threshold (older models: 8)
            max_len = int(model.meta.get("cap", 8))
        if max_len < 1 or not 0 <= min_len <= max_len:
            raise ValueError(f"need max_len >= 1 and 0 <= min_len <= max_len, got {max_len}, {min_len}")
        self.mode = mode or model.meta.get("mode", "before")
        if self.mode not in MODES:
            raise ValueError(f"DISCO mode must be one of {MODES}, got {self.mode!r}")
        self.model, self.max_len, self.min_len = model, max_len, min_len
        self._stop = False
        self.threshold = model.threshold if threshold is None else float(threshold)
        self._w = np.asarray(model.coef) / np.asarray(model.scale)
        self._b = model.intercept - float(np.dot(np.asarray(model.mean), self._w))
        self._cum = 0.0

    def probability(self, signal: DraftSignal) -> float:
        if signal.depth == 0:
            self._cum = 0.0
        t1, t2, ent = distribution_features(signal.probs)
        x = np.array([t1, t2, ent, signal.depth + 1, self._cum])
        return float(1.0 / (1.0 + math.exp(-(float(x @ self._w) + self._b))))

    def should_continue(self, signal: DraftSignal) -> bool:
        if signal.depth >= self.max_len:
            return False
        p = self.probability(signal)
        if self.mode == "after":
            self._stop = p < self.threshold
            return True
        return signal.depth < self.min_len or p >= self.threshold

    def stop_after(self, signal: DraftSignal, token) -> bool:
        self._cum += safe_log(float(signal.probs[int(token)]))
        return self._stop


@register_predictor("disco")
def fit_and_save(train: Traces, cal: Traces, target, where: Path, *, temperature: float, traces: str, max_len: int,
                 **_) -> dict:
    """Fit DISCO on one temperature's traces, save it in ``where``; returns its calibration figures."""
    m = fit(train, cal, max_len=max_len)
    m.meta.update(target=train.meta["target"], drafter=train.meta["drafter"], temperature=float(temperature),
                  traces=traces, command=command_line())
    m.save(where)
    return {**m.meta["calibration"], "mode": m.meta["mode"]}
