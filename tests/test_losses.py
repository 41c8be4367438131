"""The head kinds' losses and teachers computed the cheap way equal the plain definitions (values and gradients)."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.common.losses import hard_ce, soft_ce
from draftsmith.heads.objective import HydraObjective
from draftsmith.train.data.cache import build_cache


def _reference_soft(logits, teacher, valid):
    return -(F.softmax(teacher[valid], -1) * F.log_softmax(logits[valid], -1)).sum(-1).mean()


@pytest.mark.parametrize("share", [1.0, 0.9, 0.3, 0.0])  # masked (most rows valid) and selected (few) paths
def test_soft_and_hard_ce_equal_their_definitions_over_the_valid_rows(share):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 17, generator=g, requires_grad=True)
    teacher = torch.randn(40, 17, generator=g)
    valid = torch.rand(40, generator=g) < share
    labels = torch.where(valid, torch.randint(0, 17, (40,), generator=g), torch.full((40,), -100))
    for ours, ref in ((soft_ce(logits, teacher, valid), lambda: _reference_soft(logits, teacher, valid)),
                      (hard_ce(logits, labels), lambda: F.cross_entropy(logits[valid], labels[valid]))):
        if not valid.any():
            assert float(ours) == 0.0 and ours.requires_grad
            continue
        want = ref()
        (g1,) = torch.autograd.grad(ours, logits)
        (g2,) = torch.autograd.grad(want, logits)
        torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-7)
        assert torch.all(g1[~valid] == 0)


def test_a_batchs_teachers_from_one_product_equal_each_windows_own(tiny_target, tmp_path):
    g = torch.Generator().manual_seed(2)
    seqs = [{"ids": torch.randint(3, tiny_target.vocab_size, (n,), generator=g).tolist(),
             "mask": [0] * 4 + [1] * (n - 4)} for n in (30, 19, 41)]
    build_cache(tiny_target, seqs, ["final"], tmp_path / "c")
    cache = HiddenCache(tmp_path / "c", tiny_target)
    obj = HydraObjective(cache, tiny_target, 3, loss="soft", chunk_len=8, prefix_layer=False)
    ids = list(range(len(obj.chunks)))
    b = obj.prepare(ids)
    one = [obj.window(*obj.chunks[c], teacher=True) for c in ids]
    want = torch.cat([w.teacher for w in one if w is not None], dim=1)
    assert b.teacher.shape == want.shape and want.shape[1] > 20
    torch.testing.assert_close(b.teacher, want, rtol=1e-5, atol=1e-5)  # the same rows; one product vs many
