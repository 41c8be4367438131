import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.head_accuracy import head_accuracy, predicted_chain_tau
from draftsmith.recipe import parse_recipe
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.cache import build_cache
from draftsmith.train.training.trainer import StopTraining, build_drafter, train


def _cycle_sequences(n=24, length=48, period=11, seed=0):
    """Streams of one cycle of distinct tokens at random phases: token t+k+1 is a function of token t."""
    g = torch.Generator().manual_seed(seed)
    cyc = (torch.randperm(50, generator=g)[:period] + 3).tolist()
    seqs = []
    for _ in range(n):
        phase = int(torch.randint(0, period, (1,), generator=g))
        ids = [cyc[(phase + i) % period] for i in range(length)]
        seqs.append({"ids": ids, "mask": [0] * 8 + [1] * (length - 8)})
    return seqs


def _recipe(tmp_path, **train):
    t = {"epochs": 4, "batch_size": 4, "chunk_len": 16, "lr": 5e-3, "warmup_steps": 2, "tracker": "none",
         "save_every": 5, "log_every": 5, **train}
    return parse_recipe({"name": "t", "output_dir": str(tmp_path / "run"), "seed": 3,
                         "drafter": {"kind": "medusa", "num_heads": 3, "num_layers": 1}, "train": t})


@pytest.fixture()
def tiny_target():
    from tests.tiny import make_tiny_target
    return make_tiny_target(init_std=0.3)  # a peaky frozen head, so heads can express confident guesses


@pytest.fixture()
def cached(tiny_target, tmp_path):
    build_cache(tiny_target, _cycle_sequences(), ["final"], tmp_path / "cache", dtype="float32")
    return tmp_path / "cache"


def test_training_learns_heads(tiny_target, cached, tmp_path):
    r = _recipe(tmp_path, loss="mix", epochs=10, lr=2e-2)
    cache = HiddenCache(cached, tiny_target)
    before = head_accuracy(build_drafter(r, tiny_target), cache, 3)
    ckpt, timing = train(r, tiny_target, cached, r.out)
    from draftsmith.checkpoint import load_checkpoint
    model, man = load_checkpoint(ckpt, tiny_target)
    after = head_accuracy(model, cache, 3)
    assert after["top1"][0] > before["top1"][0] + 0.3, (before["top1"], after["top1"])
    assert timing["steps"] > 0 and 0 <= timing["outside_math_share"] <= 1
    assert man["recipe"]["name"] == "t"


def test_exact_resume_matches_uninterrupted_run(tiny_target, cached, tmp_path):
    full = _recipe(tmp_path / "a")
    ck_full, _ = train(full, tiny_target, cached, full.out)
    part = _recipe(tmp_path / "b")
    with pytest.raises(StopTraining):
        train(part, tiny_target, cached, part.out, stop_after=7)  # killed after step 7; last checkpoint at 5
    assert (part.out / "checkpoints" / "step-5" / "trainer_state.json").exists()
    ck_resumed, timing = train(part, tiny_target, cached, part.out)  # resumes from step 5
    assert timing["steps"] == json.loads((ck_full / "manifest.json").read_text())["metrics"]["step"] - 5
    a, b = load_file(str(ck_full / "model.safetensors")), load_file(str(ck_resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and a resume that restarted from scratch would differ (the test can fail)
    fresh = _recipe(tmp_path / "c", lr=6e-3)
    c = load_file(str(train(fresh, tiny_target, cached, fresh.out)[0] / "model.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_too_little_data_is_a_clear_error(tiny_target, cached, tmp_path):
    r = _recipe(tmp_path, batch_size=1000)
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        train(r, tiny_target, cached, r.out)


def test_a_probe_whose_drafter_freezes_the_module_leaves_it_training(tiny_target, cached, tmp_path, monkeypatch):
    """EAGLE-3's and the standalone kind's decoder drafters freeze the module they draft with: after a probe the
    trainable parameters must train again (the next step's loss had no gradient, and the run failed)."""
    from draftsmith.train.training import trainer

    def freezing(target, prompts, max_new_tokens):
        def probe(module):
            module.requires_grad_(False)
            return 1.0
        return probe
    monkeypatch.setattr(trainer, "tau_probe", freezing)
    r = _recipe(tmp_path, epochs=2, probe_every=2, probe_prompts=1, probe_tokens=4)
    _, timing = train(r, tiny_target, cached, r.out)
    assert len(timing["probes"]) >= 2 and timing["steps"] > 2


def test_probe_measures_tau_while_training_beside_the_prediction(tiny_target, cached, tmp_path):
    """``train.probe_every``: the lossless decoder on held-out prompts every N steps and after the last, its measured
    tau logged beside the one the logged accuracies predict; off by default."""
    from draftsmith.train.training.trainer import predicted_tau
    r = _recipe(tmp_path, epochs=3, probe_every=4, probe_prompts=2, probe_tokens=8)
    _, timing = train(r, tiny_target, cached, r.out)
    steps = [p["step"] for p in timing["probes"]]
    assert steps == sorted({s for s in range(4, timing["steps"] + 1, 4)} | {timing["steps"]})
    for p in timing["probes"]:
        assert 1.0 <= p["tau_real"] <= 9.0 and p["tau_sim"] is not None and p["tau_sim"] >= 1.0
        assert p["ratio"] == pytest.approx(p["tau_real"] / p["tau_sim"], rel=1e-3)
    off = _recipe(tmp_path / "off", epochs=1)
    assert train(off, tiny_target, cached, off.out)[1]["probes"] == []
    assert predicted_tau({"head1/top1": 0.5, "head2/top1": 0.5, "loss": 3.0}) == pytest.approx(1.75)
    assert predicted_tau({"loss": 3.0}) is None
    assert predicted_tau({"step1/top1": 0.5, "step2/top1": 0.2, "step2/top1_cond": 0.4}) == pytest.approx(1.7)


def test_predicted_chain_tau():
    assert predicted_chain_tau([]) == 1.0
    assert predicted_chain_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert predicted_chain_tau([1.0, 0.0, 1.0]) == 2.0


def test_init_from_starts_where_a_checkpoint_ended_and_refuses_another_shape(tiny_target, cached, tmp_path):
    from draftsmith.checkpoint import CheckpointError
    first = _recipe(tmp_path / "a", epochs=6, lr=2e-2)
    ck, _ = train(first, tiny_target, cached, first.out)
    trained = load_file(str(ck / "model.safetensors"))
    # zero steps of learning on top (lr tiny): the weights are the checkpoint's, not a fresh init
    more = _recipe(tmp_path / "b", max_steps=1, lr=1e-12, warmup_steps=0, init_from=str(ck))
    got = load_file(str(train(more, tiny_target, cached, more.out)[0] / "model.safetensors"))
    assert got.keys() == trained.keys()
    for k in got:
        torch.testing.assert_close(got[k], trained[k], rtol=0, atol=1e-6)
    fresh = _recipe(tmp_path / "c", max_steps=1, lr=1e-12, warmup_steps=0)
    scratch = load_file(str(train(fresh, tiny_target, cached, fresh.out)[0] / "model.safetensors"))
    assert any(not torch.allclose(scratch[k], trained[k]) for k in got)  # (the test can fail)
    other = parse_recipe({"name": "t", "output_dir": str(tmp_path / "d"), "seed": 3,
                          "drafter": {"kind": "medusa", "num_heads": 2, "num_layers": 1},
                          "train": {"max_steps": 1, "batch_size": 4, "chunk_len": 16, "tracker": "none",
                                    "init_from": str(ck)}})
    with pytest.raises(CheckpointError, match="do not fit"):
        train(other, tiny_target, cached, other.out)
    kind = parse_recipe({"name": "t", "output_dir": str(tmp_path / "e"), "seed": 3,
                         "drafter": {"kind": "hydra", "num_heads": 3, "num_layers": 1},
                         "train": {"max_steps": 1, "batch_size": 4, "chunk_len": 16, "tracker": "none",
                                   "init_from": str(ck)}})
    with pytest.raises(ValueError, match="holds a 'medusa' drafter"):
        train(kind, tiny_target, cached, kind.out)
