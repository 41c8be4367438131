"""SpecDec++ (docs/methods.md section 5): an acceptance head on the drafter's hidden state and a stop rule.

Head: L = 3 DISTINCT ResBlocks x + SiLU(W x) (W zero-initialised: the head starts as a
linear probe; the public code shares one block across the three by accident), then
Linear(d, 2); P(accept) = softmax[1]. Input: the drafter's state after consuming d_i
(the state that produces the next draft's distribution), label: ratio_i =
min(1, p(d_i)/q(d_i)) from the acceptance traces (classifiers/traces.py), so
a trace row's label pairs with the NEXT row's ``hidden`` in the same round.

Loss, w = 6 (the paper's weighting of rejections):
    sum[w (1 - y)(-log s0) + y (-log s1)] / sum[w (1 - y) + y].

Stop rule (`SpecDecStop`): per round cum = 1; at depth k >= 1 the decoder has the
state after d_k, so cum *= P(d_k accepted); when 1 - cum (the predicted probability
that some draft so far is rejected) exceeds the threshold, the candidate d_{k+1}, whose
logits are already computed, is still submitted and drafting stops (the paper's
one-token lag: its length is never below 2). Verification is unchanged: lossless.

Training: a small full-data AdamW loop, not the accelerate trainer: that loop is built
around cached target states (HiddenCache chunks, a drafter kind from the recipe, a
pruned draft vocabulary), while this head trains on a few ten thousand trace rows in
seconds. The checkpoint format is the same (model.safetensors + config.json +
manifest.json with the target fingerprint), plus the drafter it was made for.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from pydantic import Field, ValidationError
from torch import nn

from draftsmith.checkpoint import (CheckpointError, read_json, read_manifest, read_safetensors, save_checkpoint)
from draftsmith.classifiers.features import last_row
from draftsmith.classifiers.traces import TraceError, Traces, check_same_drafter
from draftsmith.classifiers.tuning import best_fixed, calibration_rounds, quality, tune_threshold_and_cap
from draftsmith.engine.policies import DraftSignal
from draftsmith.registry import register_predictor
from draftsmith.schema import StrictModel
from draftsmith.target import Target, check_fingerprint

KIND = "specdec-head"
REJECT_WEIGHT = 6.0


class ResBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHeadConfig(StrictModel):
    """The acceptance head's config.json and its constructor's one argument."""

    hidden_size: int = Field(ge=1, description="the drafter's hidden size (the width of the states it reads)")
    num_layers: int = Field(3, ge=0, description="distinct ResBlocks before the output layer")

    @classmethod
    def read(cls, raw: dict, where: str) -> "AcceptanceHeadConfig":
        """``raw`` (a config.json's dict, its ``kind`` ignored) validated; a wrong field is a `CheckpointError`
        naming ``where`` and the field."""
        try:
            return cls.model_validate({k: v for k, v in raw.items() if k != "kind"})
        except ValidationError as e:
            raise CheckpointError(f"{where}: " + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: "
                                                           f"{err['msg']}" for err in e.errors())) from None


class AcceptanceHead(nn.Module):
    """L distinct ResBlocks then Linear(d, 2) on a drafter hidden state [n, d] -> logits [n, 2]."""

    kind = KIND

    def __init__(self, config: AcceptanceHeadConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.blocks = nn.ModuleList([ResBlock(d) for _ in range(config.num_layers)])  # distinct, not [m] * L
        self.out = nn.Linear(d, 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        return self.out(h)

    @torch.no_grad()
    def accept_prob(self, h: torch.Tensor) -> torch.Tensor:
        w = self.out.weight
        return torch.softmax(self(h.to(device=w.device, dtype=w.dtype)).float(), dim=-1)[..., 1]


def weighted_bce(logits: torch.Tensor, y: torch.Tensor, w: float = REJECT_WEIGHT) -> torch.Tensor:
    """The paper's loss with soft labels y in [0, 1] (see the module docstring)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    num = (w * (1 - y) * -logp[:, 0] + y * -logp[:, 1]).sum()
    return num / (w * (1 - y) + y).sum().clamp_min(1e-12)


def pairs(t: Traces) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(hidden after d_i [n, d], ratio_i [n], per-round index of row i's pair or -1)."""
    if "hidden" not in t.columns:
        raise TraceError(f"the {t.split} traces hold no drafter hidden states (the drafter exposes none): "
                         f"SpecDec++ needs them; use DISCO for this drafter")
    hid, ratio = t.columns["hidden"], t.columns["ratio"]
    xs, ys, where = [], [], []
    n = 0
    for idx in t.rounds():
        w = np.full(len(idx), -1)
        for j in range(len(idx) - 1):  # the last draft of a round has no state after it
            xs.append(idx[j + 1])
            ys.append(idx[j])
            w[j] = n
            n += 1
        where.append(w)
    if not xs:
        return np.zeros((0, hid.shape[-1] if hid.ndim == 2 else 0), np.float32), np.zeros(0), where
    return hid[np.array(xs)].astype(np.float32), ratio[np.array(ys)].astype(np.float64), where


def train_head(train: Traces, *, num_layers: int = 3, epochs: int = 20, lr: float = 1e-3, batch_size: int = 256,
               weight_decay: float = 0.0, seed: int = 0, log=None) -> AcceptanceHead:
    """Fit the head on the train split's (state after d_i, ratio_i) pairs."""
    train.check_trainable("SpecDec++ training")
    x, y, _ = pairs(train)
    if len(x) == 0 or (y >= 1).all() or (y <= 0).all():
        raise TraceError(f"SpecDec++ training: {len(x)} (state, label) pairs, "
                         f"{'none' if len(x) == 0 else 'all one class'}: record longer drafts")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=x.shape[1], num_layers=num_layers))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).float()
    head.train()
    for ep in range(epochs):
        perm = torch.randperm(len(xt), generator=g)
        total = 0.0
        for s in range(0, len(xt), batch_size):
            b = perm[s:s + batch_size]
            loss = weighted_bce(head(xt[b]), yt[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(b)
        if log:
            log(f"specdec epoch {ep + 1}/{epochs}: loss {total / len(xt):.4f}")
    return head.eval()


def tune(head: AcceptanceHead, cal: Traces, max_len: int) -> dict:
    """Threshold on 1 - cum chosen for expected tokens per unit of cost on the calibration rounds, and
    the head's quality there (ROC AUC, calibration)."""
    rounds, ratio = calibration_rounds(cal)
    x, y, where = pairs(cal)
    a = head.accept_prob(torch.from_numpy(x)).numpy().astype(np.float64) if len(x) else np.zeros(0)
    cost = cal.meta["cost"]

    def lengths_at(thr: float, lag: bool):
        out = []
        for idx, w in zip(rounds, where):
            n, f, cum = len(idx), len(idx), 1.0
            for k in range(1, len(idx)):  # depth k: the state after d_k gives a_k (w[k - 1] is its pair)
                cum *= a[w[k - 1]]
                if 1.0 - cum > thr:
                    # lag: the candidate d_{k+1} is submitted, then drafting stops (k + 1 forwards either way)
                    n, f = (k + 1, k + 1) if lag else (k, k + 1)
                    break
            out.append((n, f))
        return out

    grid = np.linspace(0.0, 0.99, 100)
    k = min(max_len, int(cal.columns["position"].max()))
    tuned = {lag: tune_threshold_and_cap(lambda t, lag=lag: lengths_at(t, lag), grid, rounds, ratio, cost, k)
             for lag in (True, False)}
    lag = max(tuned, key=lambda m: tuned[m]["simulated"]["tokens_per_cost"] + (1e-9 if m else 0.0))
    return {"quality": quality(a, y) if len(a) else None, "lag": lag, "tuning": tuned[lag],
            "tuning_other_lag": tuned[not lag], "fixed": best_fixed(rounds, ratio, cost, k)}


def save(out: str | Path, head: AcceptanceHead, target: Target, *, drafter: dict, temperature: float,
         threshold: float, calibration: dict, traces: str, lag: bool = True) -> Path:
    return save_checkpoint(out, head, target, metrics={"calibration": calibration},
                           extra={"drafter": drafter, "temperature": temperature, "threshold": threshold,
                                  "lag": lag, "cap": int(calibration["tuning"].get("cap", 8)), "traces": traces})


def load(path: str | Path, target: Target) -> tuple[AcceptanceHead, dict]:
    """A saved head (fingerprint-checked); a file problem is a `CheckpointError` naming it."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("kind") != KIND:
        raise CheckpointError(f"{path}: holds a {manifest.get('kind')!r} checkpoint, not a SpecDec++ head ({KIND})")
    check_fingerprint(manifest["target"]["fingerprint"], target, what=f"SpecDec++ head {path}")
    cfg = AcceptanceHeadConfig.read(read_json(path / "config.json", "SpecDec++ head config"), str(path / "config.json"))
    head = AcceptanceHead(cfg)
    sd = read_safetensors(path / "model.safetensors", "SpecDec++ head weights")
    try:
        head.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path / 'model.safetensors'}: does not fit {path / 'config.json'}: "
                              f"{str(e).splitlines()[0]}") from None
    return head.eval(), manifest


def check_for(manifest: dict, drafter_ident: dict, temperature: float, what: str = "SpecDec++ head") -> None:
    check_same_drafter(manifest.get("drafter") or {}, drafter_ident, what)
    if not math.isclose(float(manifest.get("temperature", temperature)), temperature):
        raise TraceError(f"{what} was tuned at temperature {manifest.get('temperature')}, not {temperature}")


class SpecDecStop:
    """SpecDec++'s stop rule as a length policy (see the module docstring).

    Args: head, threshold on the predicted P(any rejection so far) (0.7 in the public code),
    max_len (drafts per round), lag (True: the paper's rule, the candidate whose logits are
    computed is submitted before stopping; False: stop before it).
    """

    def __init__(self, head: AcceptanceHead, threshold: float = 0.7, max_len: int = 8, lag: bool = True):
        if not 0.0 <= threshold < 1.0 or max_len < 1:
            raise ValueError(f"need 0 <= threshold < 1 and max_len >= 1, got {threshold}, {max_len}")
        self.head, self.threshold, self.max_len, self.lag = head, float(threshold), int(max_len), lag
        self._cum, self._stop = 1.0, False

    def should_continue(self, signal: DraftSignal) -> bool:
        if signal.depth >= self.max_len:
            return False
        if signal.depth == 0:
            self._cum, self._stop = 1.0, False
            return True
        h = last_row(signal.features)
        if h is None:
            raise ValueError("SpecDec++ needs the drafter's hidden state (DraftSignal.features); this drafter "
                             "exposes none")
        self._cum *= float(self.head.accept_prob(h[None])[0])
        self._stop = 1.0 - self._cum > self.threshold
        return self.lag or not self._stop

    def stop_after(self, signal: DraftSignal, token) -> bool:
        return self._stop


@register_predictor("specdec")
def fit_and_save(train: Traces, cal: Traces, target: Target, where: Path, *, temperature: float, traces: str,
                 max_len: int, epochs: int = 20, seed: int = 0, log=None, **_) -> dict:
    """Train the acceptance head on one temperature's traces, tune its stop rule, save it in ``where``;
    returns its calibration figures."""
    head = train_head(train, epochs=epochs, seed=seed, log=log)
    cal_fig = tune(head, cal, max_len)
    save(where, head, target, drafter=train.meta["drafter"], temperature=float(temperature),
         threshold=cal_fig["tuning"]["threshold"], calibration=cal_fig, traces=traces, lag=cal_fig["lag"])
    return cal_fig
