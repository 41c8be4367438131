import numpy as np
import torch

from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.heads.objective import head_labels


def test_zero_init_heads_start_as_the_lm_head(tiny_target):
    m = MedusaHeads.for_target(tiny_target, num_heads=3)
    h = torch.randn(2, 5, tiny_target.hidden_size)
    out = m(h)
    assert out.shape == (3, 2, 5, tiny_target.vocab_size)
    for k in range(3):
        torch.testing.assert_close(out[k], tiny_target.lm_head(h))


def test_no_weight_sharing_between_heads_or_layers(tiny_target):
    for share in (True, False):
        m = MedusaHeads.for_target(tiny_target, num_heads=3,
                        num_layers=2, share_lm_head=share)
        ptrs = [p.data_ptr() for n, p in m.named_parameters() if not n.startswith("lm_head")]
        assert len(ptrs) == len(set(ptrs))
        if not share:
            assert all(p.data_ptr() != tiny_target.lm_head.weight.data_ptr() for p in m.parameters())
            assert all(p.requires_grad for p in m.parameters())
        else:
            assert not m.lm_head.weight.requires_grad


def test_head_k_predicts_token_t_plus_k_plus_1():
    tokens = np.arange(100, 110)
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])
    lab = head_labels(tokens, mask, 0, 10, num_heads=3)
    # head 1 at t -> token t+2; head 3 at t -> token t+4; masked or out of range -> -100
    assert lab[0].tolist() == [-100, 103, 104, 105, 106, 107, 108, -100, -100, -100]
    assert lab[2].tolist() == [-100 if not (3 <= t + 4 <= 8) else 100 + t + 4 for t in range(10)]
    assert head_labels(tokens, mask, 4, 6, 1).tolist() == [[106, 107]]
