"""benchmarks.vocab_sweep: coverage and kept mass of a pruned draft vocabulary, checked against direct sums."""

import json

import numpy as np
import pytest
import torch

from benchmarks.vocab_sweep import main, parse_sizes
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.common.vocab import frequent_ids
from draftsmith.train.data.cache import build_cache
from tests.tiny import make_tiny_target


def _seqs(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(8, 30, (1,), generator=g))
        # a skewed id distribution, so that small kept sets cover a real share
        ids = (torch.distributions.Geometric(probs=torch.tensor(0.08)).sample((L,)).long() % (vocab - 3) + 3).tolist()
        out.append({"ids": ids, "mask": [0] * (L // 3) + [1] * (L - L // 3)})
    return out


def test_sizes_parse_and_refuse():
    assert parse_sizes("8,all,4,8", 96) == [4, 8, 96]
    with pytest.raises(SystemExit, match="between 1 and"):
        parse_sizes("0,4", 96)
    with pytest.raises(SystemExit, match="between 1 and"):
        parse_sizes("200", 96)


def test_vocab_sweep_against_direct_sums(tmp_path):
    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    train, held = _seqs(96, 12, 0), _seqs(96, 4, 1)
    build_cache(target, train, ["final"], tmp_path / "run" / "cache" / "train", dtype="float32")
    build_cache(target, held, ["final"], tmp_path / "run" / "cache" / "heldout", dtype="float32")
    rep = main(["--data", str(tmp_path / "run"), "--target", str(tmp_path / "target"), "--sizes", "4,16,all",
                "--calibration-every", "4", "--rounds", "1", "--calls", "2", "--threads", "1",
                "--out", str(tmp_path / "sweep.json")])
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"] == rep["rows"]
    rows = {r["kept"]: r for r in rep["rows"]}
    assert set(rows) == {4, 16, 96}
    # the calibration split (every 4th sequence) is left out of the count, as training leaves it out
    assert rep["train_sequences"] == 9
    kept_seqs = [s for i, s in enumerate(train) if i % 4 != 3]
    for n in (4, 16):
        ids = frequent_ids((np.array(s["ids"]) for s in kept_seqs), (np.array(s["mask"]) for s in kept_seqs), 96, n)
        answers = np.concatenate([np.array(s["ids"])[np.array(s["mask"]) > 0] for s in held])
        assert rows[n]["heldout_coverage"] == pytest.approx(np.isin(answers, ids.numpy()).mean())
        # kept mass: the target's probability on the kept ids at every position that predicts an answer token
        cache = HiddenCache(tmp_path / "run" / "cache" / "heldout", target)
        mass, count = 0.0, 0
        for i, s in enumerate(held):
            p = torch.softmax(teacher_logits(target, cache.states(i, "final")).float(), -1)
            pos = np.nonzero(np.array(s["mask"])[1:] > 0)[0]
            mass += float(p[pos][:, ids].sum())
            count += len(pos)
        assert rows[n]["heldout_kept_mass"] == pytest.approx(mass / count, rel=1e-5)
    assert rows[4]["heldout_kept_mass"] < rows[16]["heldout_kept_mass"] < 1.0
    assert rows[4]["train_coverage"] < rows[16]["train_coverage"]
    for k in ("train_coverage", "heldout_coverage", "heldout_argmax_kept", "heldout_kept_mass"):
        assert rows[96][k] == pytest.approx(1.0)
    assert all(r["bf16_ms"] > 0 and r["int8_ms"] > 0 for r in rep["rows"])
