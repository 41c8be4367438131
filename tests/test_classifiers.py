"""Acceptance predictors (classifiers/): traces, DISCO, SpecDec++, the HF ROC refit; all on tiny models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from draftsmith.checkpoint import CheckpointError
from draftsmith.classifiers.disco import model as disco
from draftsmith.classifiers.specdec import model as specdec
from draftsmith.classifiers.roc import RocRefitStop
from draftsmith.classifiers.traces import (TraceError, Traces, TraceRecorder, drafter_identity, load_traces, record,
                                           save_traces)
from draftsmith.classifiers.tuning import expected_emitted, quality
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.heads.decode import HeadDrafter
from draftsmith.engine.drafting import GrowContext, grow_chain
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.engine.sampling import SamplingParams, TorchRandom, processed_probs
from draftsmith.engine.trees import DraftTree
from draftsmith.target import TargetMismatchError
from tests.test_decoder import tiny
from tests.test_hydra import random_hydra
from tests.test_kangaroo import kangaroo

PROMPT = [1, 3, 4, 2, 5]
COST = {"verify": [1.0] + [1.0 + 0.1 * n for n in range(1, 9)], "draft_per_forward": 0.05, "one_row_s": 1.0}


# ---------------------------------------------------------------------------- traces
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_trace_labels_match_a_hand_computed_case(temperature):
    """Every row's label and features recomputed from full, cache-free forwards of target and drafter."""
    t = tiny(vocab=12, seed=4, std=0.6)
    dr = first_layers_drafter(t, 1)
    sp = SamplingParams(temperature)
    rows, _ = record(t, dr, [PROMPT], sp, draft_len=3, max_new_tokens=24, seed=3)
    dec_tokens = SpeculativeDecoder(t, dr, policy=FixedLength(3), sampling=sp).generate(PROMPT, 24, seed=3)
    assert rows and {r["prompt"] for r in rows} == {0}
    prefix_len = {0: 0}
    for s, st in enumerate(dec_tokens.steps):
        prefix_len[s + 1] = prefix_len[s] + st.emitted
    for r in rows:
        step_rows = sorted((x for x in rows if x["step"] == r["step"]), key=lambda x: x["position"])
        st = dec_tokens.steps[r["step"]]
        drafted = [x["token"] for x in step_rows[: r["position"] - 1]]
        ctx = PROMPT + dec_tokens.tokens[: prefix_len[r["step"]]] + drafted
        with torch.no_grad():
            p_logits = t.model(torch.tensor([ctx])).logits[0, -1]
            q_logits = dr.model(torch.tensor([ctx])).logits[0, -1]
        p = processed_probs(p_logits, temperature)
        q = processed_probs(q_logits, temperature)
        conf = q if temperature > 0 else torch.softmax(q_logits, -1)
        assert r["token"] == (int(q_logits.argmax()) if temperature == 0 else r["token"])
        want = min(1.0, float(p[r["token"]] / q[r["token"]]))
        # cached vs cache-free forwards round differently; p/q amplifies it where q is small
        assert r["ratio"] == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert r["top1"] == pytest.approx(float(conf.max()), abs=1e-5)
        assert r["q_token"] == pytest.approx(float(conf[r["token"]]), abs=1e-5)
        assert r["cum_q"] == pytest.approx(np.prod([x["q_token"] for x in step_rows[: r["position"]]]), rel=1e-5)
        assert r["prefix_accepted"] == (r["position"] <= st.accepted + 1)
        assert r["accepted"] == (r["position"] <= st.accepted)
        if temperature == 0 and r["prefix_accepted"]:
            assert r["accepted"] == (r["ratio"] == 1.0)  # greedy: accepted iff the target's argmax
        assert r["hidden"] is not None and r["hidden"].shape == (t.hidden_size,)


def test_recording_keeps_decoding_lossless():
    t = tiny(vocab=12, seed=4, std=0.6)
    dr = first_layers_drafter(t, 1)
    plain = SpeculativeDecoder(t).generate(PROMPT, 30).tokens
    rec = TraceRecorder(FixedLength(4), SamplingParams())
    assert SpeculativeDecoder(t, dr, policy=rec).generate(PROMPT, 30).tokens == plain
    assert len(rec.rows) == sum(s["drafted"] for s in rec.steps) > 0


def test_traces_save_load_and_bad_sets(tmp_path):
    t = tiny(vocab=12, seed=4, std=0.6)
    dr = first_layers_drafter(t, 1)
    rows, _ = record(t, dr, [PROMPT, [1, 4, 4, 6], [1, 7, 3]], SamplingParams(), draft_len=3, max_new_tokens=12)
    meta = {"target": {"name": t.name, "fingerprint": t.fingerprint}, "drafter": drafter_identity(dr), "cost": COST}
    save_traces(tmp_path / "tr", rows, meta, calibration_every=3)
    tr, cal = load_traces(tmp_path / "tr", "train"), load_traces(tmp_path / "tr", "calibration")
    assert len(tr) + len(cal) == len(rows) and set(cal.columns["prompt"]) == {2}
    assert tr.columns["hidden"].shape[1] == t.hidden_size
    with pytest.raises(TraceError, match="no drafted tokens"):
        save_traces(tmp_path / "empty", [], meta)
    with pytest.raises(TraceError, match="temperature 0.7"):
        tr.at_temperature(0.7)
    empty = Traces({k: v[:0] for k, v in tr.columns.items()}, meta, "train")
    with pytest.raises(TraceError, match="no trace rows"):
        empty.check_trainable("x")
    one = Traces({**tr.columns, "ratio": np.ones(len(tr))}, meta, "train")
    with pytest.raises(TraceError, match="one class"):
        disco.fit(one, cal, max_len=3)
    with pytest.raises(TraceError, match="one class"):
        specdec.train_head(one)
    with pytest.raises(CheckpointError, match="missing"):
        load_traces(tmp_path / "nothing", "train")


# ---------------------------------------------------------------------------- synthetic trace sets
def synthetic(n_rounds=200, k=6, d=8, seed=0, split="train", meta=None) -> Traces:
    """Rounds whose acceptance follows top1 (DISCO's signal) and hidden[:, 0] (SpecDec++'s)."""
    rng = np.random.default_rng(seed)
    cols = {c: [] for c in ("prompt", "step", "temperature", "position", "top1", "top2", "entropy", "log_cum_prev",
                            "ratio", "hidden")}
    for r in range(n_rounds):
        cum = 0.0
        hid_next = rng.normal(size=d)
        for i in range(1, k + 1):
            top1 = rng.uniform(0.05, 1.0)
            hid, hid_next = hid_next, rng.normal(size=d)
            acc = float(rng.uniform() < top1)
            hid_next[0] = 3.0 * (2 * acc - 1) + rng.normal(scale=0.5)  # the state after d_i knows its fate
            for c, v in (("prompt", r), ("step", 0), ("temperature", 0.0), ("position", i), ("top1", top1),
                         ("top2", (1 - top1) / 2), ("entropy", 1 - top1), ("log_cum_prev", cum), ("ratio", acc),
                         ("hidden", hid)):
                cols[c].append(v)
            cum += np.log(top1)
    out = {c: np.asarray(v) for c, v in cols.items()}
    out["hidden"] = out["hidden"].astype(np.float16)
    return Traces(out, meta or {"cost": COST, "target": {"fingerprint": "x"}, "drafter": {"name": "d"}}, split)


def test_disco_saved_and_reloaded_predicts_identically(tmp_path):
    tgt = tiny(vocab=12, seed=4)
    meta = {"cost": COST, "target": {"name": tgt.name, "fingerprint": tgt.fingerprint},
            "drafter": {"name": "first-1-layers", "weights_sha256": None}}
    tr, cal = synthetic(meta=meta), synthetic(seed=1, split="calibration", meta=meta)
    m = disco.fit(tr, cal, max_len=6)
    m.meta.update(target=meta["target"], drafter=meta["drafter"], temperature=0.0)
    m.save(tmp_path / "disco")
    back = disco.load(tmp_path / "disco")
    x = disco.feature_matrix(cal)
    assert np.array_equal(m.predict(x), back.predict(x)) and back.threshold == m.threshold
    q = m.meta["calibration"]["quality"]
    assert q["roc_auc"] > 0.7  # acceptance follows top1 in this set
    disco.check_for(back, tgt, {"name": "first-1-layers"}, 0.0)
    with pytest.raises(TargetMismatchError):
        disco.check_for(back, tiny(vocab=12, seed=5), {"name": "first-1-layers"}, 0.0)
    with pytest.raises(TraceError, match="made for drafter"):
        disco.check_for(back, tgt, {"name": "other", "weights_sha256": "ab"}, 0.0)
    with pytest.raises(TraceError, match="temperature"):
        disco.check_for(back, tgt, {"name": "first-1-layers"}, 0.7)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "disco.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed JSON"):
        disco.load(tmp_path / "bad")
    d = json.loads((tmp_path / "disco" / "disco.json").read_text())
    d["coef"] = d["coef"][:2]
    (tmp_path / "bad" / "disco.json").write_text(json.dumps(d))
    with pytest.raises(TraceError, match="coefficients"):
        disco.load(tmp_path / "bad")


def test_weighted_bce_by_hand():
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    y = torch.tensor([1.0, 0.25])
    lp = torch.log_softmax(logits, -1)
    want = (-lp[0, 1] + 6 * 0.75 * -lp[1, 0] + 0.25 * -lp[1, 1]) / (1 + 6 * 0.75 + 0.25)
    assert float(specdec.weighted_bce(logits, y)) == pytest.approx(float(want))


def test_specdec_head_trains_saves_and_loads(tmp_path):
    tgt = tiny(vocab=12, seed=4)
    tr, cal = synthetic(), synthetic(seed=1, split="calibration")
    head = specdec.train_head(tr, epochs=40, lr=3e-3, seed=0)
    assert all(a is not b for a, b in zip(head.blocks, list(head.blocks)[1:]))  # distinct blocks
    fig = specdec.tune(head, cal, 6)
    assert fig["quality"]["roc_auc"] > 0.9
    specdec.save(tmp_path / "s", head, tgt, drafter={"name": "d"}, temperature=0.0,
                 threshold=fig["tuning"]["threshold"], calibration=fig, traces="x")
    back, man = specdec.load(tmp_path / "s", tgt)
    h = torch.from_numpy(cal.columns["hidden"][:50].astype(np.float32))
    assert torch.equal(head.accept_prob(h), back.accept_prob(h))
    with pytest.raises(TargetMismatchError):
        specdec.load(tmp_path / "s", tiny(vocab=12, seed=5))
    with pytest.raises(TraceError, match="made for drafter"):
        specdec.check_for(man, {"name": "other"}, 0.0)
    no_hidden = Traces({k: v for k, v in tr.columns.items() if k != "hidden"}, tr.meta, "train")
    with pytest.raises(TraceError, match="no drafter hidden states"):
        specdec.train_head(no_hidden)
    # config.json is the head's pydantic config: read back equal; a wrong field is refused by name
    cfg_file = tmp_path / "s" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    assert cfg["kind"] == specdec.KIND and back.config == head.config
    for bad, field in (({**cfg, "num_layers": -1}, "num_layers"), ({**cfg, "width": 3}, "width"),
                       ({"kind": specdec.KIND, "num_layers": 3}, "hidden_size")):
        cfg_file.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=field):
            specdec.load(tmp_path / "s", tgt)


# ---------------------------------------------------------------------------- stop rules
class ConstHead(torch.nn.Module):
    def __init__(self, a: float):
        super().__init__()
        self.a = a
        self.out = torch.nn.Linear(1, 1)

    def accept_prob(self, h):
        return torch.full((h.shape[0],), self.a)


def chain_length(policy, depth_cap=20, vocab=6) -> int:
    """Draft one chain through the engine's grower with a constant drafter; the length it reached."""
    tree = DraftTree(0, 32, torch.device("cpu"))
    calls = []

    def propose(tr, s, e):
        calls.append(s)
        return torch.tensor([[3.0] + [0.0] * (vocab - 1)])

    ctx = GrowContext(propose=propose, sampling=SamplingParams(), ranked=True, rng=TorchRandom(0), eos=frozenset(),
                      depth_cap=depth_cap, features=lambda: torch.ones(1, 4))
    grow_chain(tree, ctx, policy)
    return tree.n, len(calls)


@pytest.mark.parametrize("a,thr,lag,want", [
    (0.5, 0.7, True, 3),  # 1 - 0.5 = 0.5 <= 0.7 at k=1; 1 - 0.25 > 0.7 at k=2 -> d_3 submitted, then stop
    (0.5, 0.7, False, 2),  # without the lag: stop before the candidate
    (0.1, 0.0, True, 2),  # the lag's lower bound: never fewer than 2
    (1.0, 0.3, True, 8),  # never predicted to fail: the upper bound max_len
    (0.9, 0.3, True, 5),  # 1 - 0.9^4 = 0.344 > 0.3 first at k=4 -> length 5
])
def test_specdec_stop_rule_lag_and_bounds(a, thr, lag, want):
    n, forwards = chain_length(specdec.SpecDecStop(ConstHead(a), thr, max_len=8, lag=lag))
    assert n == want
    assert forwards == min(want + (0 if lag or want == 8 else 1), 8)  # the lagged token costs no drafter forward


def test_specdec_bounds_and_bad_input():
    assert chain_length(specdec.SpecDecStop(ConstHead(0.1), 0.5, max_len=1))[0] == 1
    assert chain_length(specdec.SpecDecStop(ConstHead(1.0), 0.5, max_len=8), depth_cap=3)[0] == 3
    with pytest.raises(ValueError):
        specdec.SpecDecStop(ConstHead(0.5), 1.0)
    with pytest.raises(ValueError):
        specdec.SpecDecStop(ConstHead(0.5), 0.5, max_len=0)
    pol = specdec.SpecDecStop(ConstHead(0.5), 0.5)
    from draftsmith.engine.policies import DraftSignal
    pol.should_continue(DraftSignal(0, torch.zeros(4)))
    with pytest.raises(ValueError, match="hidden state"):
        pol.should_continue(DraftSignal(1, torch.zeros(4), features=None))
    with pytest.raises(ValueError):
        disco.DiscoStop(disco.DiscoModel([0] * 5, [1] * 5, [0] * 5, 0.0), max_len=0)


def test_roc_refit_matches_hf_bookkeeping():
    from sklearn.metrics import roc_curve

    from draftsmith.engine.trees import Verdict
    pol = RocRefitStop(0.4, max_len=8)
    probs_hf, matches_hf = [], []
    rounds = [([0.9, 0.8, 0.3], 2), ([0.95, 0.6], 2), ([0.7, 0.5, 0.45], 0), ([0.99, 0.2], 1)]
    for probs, acc in rounds:
        for p in probs:
            pol.probs.append(p)
        pol.observe(None, None, Verdict(list(range(acc + 1)), [], acc), None)
        probs_hf += probs
        matches_hf += [1] * acc
        if len(probs_hf) > len(matches_hf):
            matches_hf.append(0)
        del probs_hf[len(matches_hf):]
    assert pol.probs == probs_hf and pol.matches == matches_hf
    fpr, tpr, th = roc_curve(matches_hf, probs_hf)
    assert pol.threshold == float(th[np.argmin(fpr + 3 * (1 - tpr))]) and pol.refits >= 1
    pol.reset()
    assert pol.threshold == 0.4 and pol.probs == [] and pol.matches == []


def test_tuning_helpers():
    assert expected_emitted(np.array([1.0, 0.5, 0.5]), 3) == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert expected_emitted(np.array([0.3]), 0) == 1.0
    q = quality(np.array([0.9, 0.1, 0.8, 0.2]), np.array([1.0, 0.0, 1.0, 0.0]))
    assert q["roc_auc"] == 1.0 and q["brier"] == pytest.approx(0.025)
    with pytest.raises(TraceError):
        quality(np.zeros(0), np.zeros(0))


def test_tuned_cap_makes_policies_at_least_the_best_fixed_k():
    """Tuning the cap with the threshold: cap K with a threshold that never stops is fixed length K, so the
    tuned DISCO and SpecDec++ policies simulate at least the best fixed K on the calibration rounds."""
    from draftsmith.classifiers.tuning import tune_threshold, tune_threshold_and_cap

    t = tiny(vocab=12, seed=9, std=0.5)
    tr, cal = synthetic(d=t.hidden_size), synthetic(d=t.hidden_size, seed=1, split="calibration")
    m = disco.fit(tr, cal, max_len=6)
    c = m.meta["calibration"]
    assert 1 <= m.meta["cap"] <= 6 and c["tuning"]["cap"] == m.meta["cap"]
    assert c["tuning"]["simulated"]["tokens_per_cost"] >= c["fixed"]["best"]["tokens_per_cost"] - 1e-9
    assert disco.DiscoStop(m).max_len == m.meta["cap"]
    fig = specdec.tune(specdec.train_head(tr, epochs=1), cal, 6)
    assert fig["tuning"]["simulated"]["tokens_per_cost"] >= fig["fixed"]["best"]["tokens_per_cost"] - 1e-9
    # a policy that always drafts everything, with costs that make long rounds lose: the cap finds K = 1
    rounds, ratio = [np.arange(i * 4, i * 4 + 4) for i in range(5)], np.full(20, 0.3)
    cost = {"verify": [1.0, 1.5, 2.0, 2.5, 3.0]}
    full = lambda thr: [(4, 4)] * 5  # noqa: E731
    assert tune_threshold_and_cap(full, np.array([0.5]), rounds, ratio, cost, 4)["cap"] == 1
    assert tune_threshold_and_cap(full, np.array([0.5]), rounds, ratio, cost, 4)["simulated"]["tokens_per_cost"] > \
        tune_threshold(full, np.array([0.5]), rounds, ratio, cost)["simulated"]["tokens_per_cost"]


# ---------------------------------------------------------------------------- lossless with every policy
def _policies(t, max_len=5):
    tr, cal = synthetic(d=t.hidden_size), synthetic(d=t.hidden_size, seed=1, split="calibration")
    head = specdec.train_head(tr, epochs=1)
    return {"confidence": ConfidenceStop(0.4, max_len), "roc": RocRefitStop(0.4, max_len),
            "disco": disco.DiscoStop(disco.fit(tr, cal, max_len=max_len), max_len),
            "specdec": specdec.SpecDecStop(head, 0.5, max_len)}


@pytest.mark.parametrize("family", ["model", "hydra", "kangaroo"])
def test_policies_keep_greedy_decoding_lossless(family):
    t = tiny(vocab=12, seed=9, std=0.5)
    plain = SpeculativeDecoder(t).generate(PROMPT, 40).tokens
    if family == "model":
        dr = first_layers_drafter(t, 1)
    elif family == "hydra":
        dr = HeadDrafter(random_hydra(t, num_heads=4, prefix=True), t.fingerprint, name="hydra")
    else:
        dr = kangaroo(t, exit_layer=1)
    pols = _policies(t, max_len=4)
    pols["disco-other-mode"] = disco.DiscoStop(pols["disco"].model, 4,
                                               mode="after" if pols["disco"].mode == "before" else "before")
    for name, pol in pols.items():
        res = SpeculativeDecoder(t, dr, policy=pol).generate(PROMPT, 40)
        assert res.tokens == plain, name
        assert sum(s.drafted for s in res.steps) > 0, name


def test_policies_keep_sampling_distribution_chi_square():
    """Sampling at T=1 with the learned policies: first-two-token distribution vs plain sampling's exact one."""
    from scipy.stats import chisquare

    t = tiny(vocab=6, seed=2, std=0.8, layers=2)
    dr = first_layers_drafter(t, 1)
    sp = SamplingParams(1.0)
    with torch.no_grad():
        p1 = torch.softmax(t.model(torch.tensor([PROMPT])).logits[0, -1].double(), -1)
        ctx = torch.tensor([PROMPT + [a] for a in range(6)])
        p2 = torch.softmax(t.model(ctx).logits[:, -1].double(), -1)
    joint = p1[:, None] * p2
    eos = 2  # an EOS first token ends the answer: its mass sits in cell (eos, eos)
    joint[eos] = 0.0
    joint[eos, eos] = p1[eos]
    exact = joint.flatten().numpy()
    pols = _policies(t, max_len=3)
    for name in ("roc", "disco", "specdec"):  # ConfidenceStop is covered by the decoder's own tests
        pol = pols[name]
        dec = SpeculativeDecoder(t, dr, policy=pol, sampling=sp)
        counts = np.zeros(36)
        n = 600
        for s in range(n):
            toks = dec.generate(PROMPT, 4, seed=s).tokens  # room for 3 drafts in the first step
            a, b = toks[0], toks[1] if len(toks) > 1 else eos
            counts[a * 6 + b] += 1
        keep = exact * n >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(exact[keep] * n, exact[~keep].sum() * n)
        assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3, name


def test_traces_stage_and_predictors_end_to_end(tmp_path):
    """The pipeline path: training prompts from data/train.jsonl -> traces -> DISCO + SpecDec++ per temperature,
    then the policies load (identity-checked) and decode losslessly."""
    from types import SimpleNamespace

    from draftsmith.train.training.predictors import load_drafter, stage_traces, temperature_dir, train_predictors
    t = tiny(vocab=40, seed=4, std=0.6)
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        for i, text in enumerate(["abc", "hello there", "what is up", "tell me", "no", "zzz top", "a b c", "qq"]):
            f.write(json.dumps({"id": f"x{i}", "system": None, "messages": [
                {"role": "user", "content": text}, {"role": "assistant", "content": "ok"}], "finished": [True]}) + "\n")
        f.write("{broken\n")
    res = stage_traces(SimpleNamespace(out=tmp_path), t, checkpoint="first-layers:1", prompts=20, max_new_tokens=24,
                       draft_len=4, temperatures=(0.0, 0.7), calibration_every=4)
    assert res["prompts"] == 8 and res["prompts_skipped"]["malformed"] == 1
    assert len(res["cost"]["verify"]) == 5
    summary = train_predictors(tmp_path / "traces", t, max_len=4, epochs=2)
    assert set(summary) == {"0", "0.7"} and set(summary["0"]) == {"disco", "specdec"}
    dr, ident = load_drafter("first-layers:1", t)
    m = disco.load(temperature_dir(tmp_path / "predictors", 0.0) / "disco")
    disco.check_for(m, t, ident, 0.0)
    head, man = specdec.load(temperature_dir(tmp_path / "predictors", 0.0) / "specdec", t)
    specdec.check_for(man, ident, 0.0)
    plain = SpeculativeDecoder(t).generate(PROMPT, 30).tokens
    for pol in (disco.DiscoStop(m, 4), specdec.SpecDecStop(head, float(man["threshold"]), 4)):
        assert SpeculativeDecoder(t, dr, policy=pol).generate(PROMPT, 30).tokens == plain
    with pytest.raises(TraceError, match="made for drafter"):
        disco.check_for(m, t, load_drafter("first-layers:2", t)[1], 0.0)


def test_cli_parses_and_reports_bad_input(tmp_path, capsys):
    from draftsmith.cli import build_parser, main
    a = build_parser().parse_args(["traces", "quickstart", "--checkpoint", "early-exit:6", "--temperature", "0"])
    assert a.checkpoint == "early-exit:6" and a.temperature == [0.0] and a.draft_len == 8
    assert main(["predictors", str(tmp_path / "none")]) == 2
    assert "missing" in capsys.readouterr().err
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "meta.json").write_text("[1, 2]")
    assert main(["predictors", str(tmp_path / "t")]) == 2
    assert "expected a JSON object" in capsys.readouterr().err
