"""RDK: the sparse affinity map against a dense reference on a tiny vocabulary, q_RDK is a
distribution, rows stay stochastic, bad maps are refused. Exact losslessness of RDK drafting is in
tests/test_standalone.py (enumeration with drafted pruned ids)."""

import pytest
import torch

from draftsmith.drafters.standalone.rdk import RDKMap, build_rdk, dense_affinity_reference
from draftsmith.common.hidden_cache import HiddenCache, teacher_logits
from draftsmith.train.data.cache import build_cache
from tests.test_train import _cycle_sequences
from tests.tiny import make_tiny_target

KEEP = torch.tensor([3, 5, 8, 13, 21, 34, 40, 47])


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rdk")
    t = make_tiny_target(vocab_size=50, init_std=0.5, layers=2)
    build_cache(t, _cycle_sequences(n=4, length=30), ["final"], tmp / "c", dtype="float32")
    cache = HiddenCache(tmp / "c", t)
    parent, weight, info = build_rdk(cache, t, KEEP, topk=64)  # top-k >= V: every pair counted
    rows = []
    for i in range(len(cache)):
        m = cache.mask(i)
        r = torch.from_numpy((m[1:] > 0).nonzero()[0])
        rows.append(torch.softmax(teacher_logits(t, cache.states(i, "final")[r]).double(), -1))
    return t, parent, weight, info, torch.cat(rows)


def test_sparse_map_matches_the_dense_reference(fitted):
    t, parent, weight, info, p = fitted
    dense = dense_affinity_reference(p, KEEP)  # M*[i, j] = E[p(j) | i drawn from q']
    torch.testing.assert_close(dense.sum(-1), torch.ones(len(KEEP), dtype=torch.float64))
    # the reference reproduces the target's average distribution exactly (docs/rdk.md)
    q = p[:, KEEP] / p[:, KEEP].sum(-1, keepdim=True)
    torch.testing.assert_close((q @ dense).mean(0), p.mean(0))
    pruned = [j for j in range(t.vocab_size) if j not in set(KEEP.tolist())]
    c = (q.T @ p)  # C[i, j]
    assert info["attached"] == len(pruned) == info["pruned"]
    for j in pruned:  # each pruned column keeps its largest contributor, with the reference's entry
        i = int(c[:, j].argmax())
        assert int(parent[j]) == int(KEEP[i])
        assert float(weight[j]) == pytest.approx(float(dense[i, j]), rel=1e-5, abs=1e-7)
    assert (parent[KEEP] == -1).all()


def test_q_rdk_is_a_distribution_and_equals_the_dense_product(fitted):
    t, parent, weight, _, _ = fitted
    m = RDKMap(KEEP, t.vocab_size)
    m.set(KEEP, parent, weight)
    M = m.dense()
    torch.testing.assert_close(M.sum(-1), torch.ones(len(KEEP), dtype=torch.float64))
    assert (M >= 0).all() and int((M != 0).sum()) <= t.vocab_size  # sparse: at most V non-zeros, not N x V
    qk = torch.softmax(torch.randn(5, len(KEEP), dtype=torch.float64), -1)
    r = m.redistribute(qk)
    torch.testing.assert_close(r, qk @ M)
    torch.testing.assert_close(r.sum(-1), torch.ones(5, dtype=torch.float64))
    lg = torch.randn(4, len(KEEP))
    torch.testing.assert_close(torch.softmax(m.logits(lg), -1), m.redistribute(torch.softmax(lg, -1)),
                               atol=1e-6, rtol=1e-5)


def test_bad_maps_are_refused():
    m = RDKMap(KEEP, 50)
    parent, weight = torch.full((50,), -1), torch.zeros(50)
    bad = parent.clone()
    bad[KEEP[0]] = int(KEEP[1])
    with pytest.raises(ValueError, match="only pruned ids may be attached"):
        m.set(KEEP, bad, weight)
    bad = parent.clone()
    bad[0] = 1  # 1 is not kept
    w = weight.clone()
    w[0] = 0.1
    with pytest.raises(ValueError, match="only to kept ids"):
        m.set(KEEP, bad, w)
    over = parent.clone()
    over[0], over[1] = int(KEEP[0]), int(KEEP[0])
    w = weight.clone()
    w[0], w[1] = 0.7, 0.6
    with pytest.raises(ValueError, match="rows must be stochastic"):
        m.set(KEEP, over, w)
    with pytest.raises(ValueError, match="q' has 3 entries"):
        m.redistribute(torch.ones(3) / 3)


def test_row_mass_stays_below_one_with_truncated_pairs(fitted, tmp_path):
    t = fitted[0]
    build_cache(t, _cycle_sequences(n=4, length=30), ["final"], tmp_path / "c", dtype="float32")
    parent, weight, _ = build_rdk(HiddenCache(tmp_path / "c", t), t, KEEP, topk=2)
    m = RDKMap(KEEP, t.vocab_size)
    m.set(KEEP, parent, weight)  # validates stochastic rows
    assert float(RDKMap.row_mass(KEEP, parent, weight).max()) <= 1.0


def test_table_alpha_pools_tested_drafts():
    """standalone_table's alpha: accepted / tested drafts, a chain testing up to its first rejection."""
    from types import SimpleNamespace as NS
    from benchmarks.standalone_table import draft_ms_per_token, pooled_alpha
    steps = [NS(drafted=4, attempted=4, accepted=4, draft_s=0.04), NS(drafted=4, attempted=2, accepted=1, draft_s=0.04),
             NS(drafted=4, attempted=1, accepted=0, draft_s=0.04)]
    r = [NS(steps=steps)]
    assert pooled_alpha(r) == pytest.approx(5 / (4 + 2 + 1))
    assert draft_ms_per_token(r) == pytest.approx(10.0)  # per drafted token: 120 ms / 12, not / 7 tested
    assert pooled_alpha([NS(steps=[])]) is None


def test_column_weights_move_a_pruned_ids_whole_mean_mass_within_the_row_cap(tmp_path):
    t = make_tiny_target(vocab_size=50, init_std=0.5, layers=2)
    build_cache(t, _cycle_sequences(n=4, length=30), ["final"], tmp_path / "c", dtype="float32")
    cache = HiddenCache(tmp_path / "c", t)
    cond = build_rdk(cache, t, KEEP, topk=64)
    col_parent, col_w, _ = build_rdk(cache, t, KEEP, topk=64, weights="column")
    assert torch.equal(col_parent, cond[0])  # the same parents; only the weights differ
    rows = []
    for i in range(len(cache)):
        r = torch.from_numpy((cache.mask(i)[1:] > 0).nonzero()[0])
        rows.append(torch.softmax(teacher_logits(t, cache.states(i, "final")[r]).double(), -1))
    p = torch.cat(rows)
    q = p[:, KEEP] / p[:, KEEP].sum(-1, keepdim=True)
    att = (col_parent >= 0).nonzero().flatten()
    t2d = {int(k): n for n, k in enumerate(KEEP)}
    c_i = q.sum(0)
    mass = RDKMap.row_mass(KEEP, col_parent, col_w)
    for j in att.tolist():  # w_j = sum_t p_t(j) / C_a(j), unless its row was scaled down to 1
        i = t2d[int(col_parent[j])]
        if float(mass[i]) < 1 - 1e-6:
            assert float(col_w[j]) == pytest.approx(float(p[:, j].sum() / c_i[i]), rel=1e-4)
    assert float(mass.max()) <= 1 + 1e-6 and float(col_w.sum()) > float(cond[1].sum())
    _, capped, _ = build_rdk(cache, t, KEEP, topk=64, weights="column", max_row_mass=0.3)
    assert float(RDKMap.row_mass(KEEP, col_parent, capped).max()) <= 0.3 + 1e-6
    RDKMap(KEEP, t.vocab_size).set(KEEP, col_parent, capped)  # a valid map
    for bad in ({"weights": "dense"}, {"max_row_mass": 0.0}, {"max_row_mass": 1.5}):
        with pytest.raises(ValueError, match="rdk"):
            build_rdk(cache, t, KEEP, topk=64, **bad)
