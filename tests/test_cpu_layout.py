"""The opt-in CPU decoding layout changes how weights are stored, never what the decoder emits."""

import copy

import pytest
import torch

from draftsmith.engine.cpu_layout import (WEIGHT_T, apply_cpu_layout, column_major_linears, cpu_decode_layout,
                                        onednn_available, pack_linears, packed_weight)
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.drafters import project
from draftsmith.engine.trees import DynamicTree
from tests.tiny import make_tiny_target

TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_linears_go_column_major_with_the_same_values():
    tgt = make_tiny_target(seed=3)
    model = tgt.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 5, 9, 12, 40, 7]])
    ref = model(ids).logits
    n = cpu_decode_layout(model)
    assert n["linears"] == 7 * model.config.num_hidden_layers  # q k v o gate up down
    assert n["heads"] == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
        if name.endswith("proj.weight"):
            assert not p.is_contiguous() and p.t().is_contiguous(), name
    # the tied output head / input embeddings keep their row-major storage and stay tied
    assert model.lm_head.weight.is_contiguous()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
    assert cpu_decode_layout(model)["linears"] == 0  # idempotent


def test_vocabulary_projections_and_tied_weights_are_left_alone():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 128, bias=False), torch.nn.Linear(8, 8))
    m[2].weight = m[0].weight  # tied
    assert column_major_linears(m) == 0


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_project_with_the_transposed_copy_is_the_same_product(rows):
    head = torch.nn.Linear(16, 300, bias=False)
    x = torch.randn(rows, 16)
    ref = torch.nn.functional.linear(x, head.weight)
    cpu_decode_layout(torch.nn.ModuleDict({"lm_head": head}))
    assert getattr(head, WEIGHT_T).shape == (16, 300)
    torch.testing.assert_close(project(head, x), ref, rtol=1e-5, atol=1e-6)
    assert WEIGHT_T not in dict(head.named_parameters()) and WEIGHT_T not in dict(head.named_buffers())
    assert WEIGHT_T not in head.state_dict()


@pytest.mark.parametrize("tree", [None, TREE, DynamicTree(6, 3, 2)], ids=["chain", "static", "dynamic"])
def test_greedy_output_unchanged_by_the_layout(tree):
    tgt = make_tiny_target(seed=5)
    prompt = [1, 10, 20, 30, 4, 8]
    ref_plain = SpeculativeDecoder(tgt).generate(prompt, 24).tokens
    laid = copy.deepcopy(tgt)
    dr = first_layers_drafter(laid, 1)
    done = apply_cpu_layout(laid, dr)
    assert done["applied"] and done["linears"] > 0 and done["heads"] == 2
    assert SpeculativeDecoder(laid).generate(prompt, 24).tokens == ref_plain
    assert SpeculativeDecoder(laid, dr, tree=tree).generate(prompt, 24).tokens == ref_plain


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packed linear")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (1, 2, 16), (1, 5, 16), (9, 16)])  # 2 rows: padded to 4
def test_packed_linears_compute_the_same_product(shape, bias):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=bias), torch.nn.Linear(32, 8, bias=bias))
    x = torch.randn(*shape)
    with torch.no_grad():
        ref = m(x)
        assert pack_linears(m) == 2
        assert all(packed_weight(lin) is not None for lin in m)
        torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_falls_back_when_its_weight_changes_or_is_copied():
    lin = torch.nn.Linear(16, 32)
    pack_linears(lin)
    x = torch.randn(4, 16)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the packed copy is stale and must not be used
        assert packed_weight(lin) is None
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    lin2 = torch.nn.Linear(16, 32)
    pack_linears(lin2)
    dup = copy.deepcopy(lin2)  # opaque oneDNN tensors cannot be copied: the copy drops its packing
    assert packed_weight(dup) is None and packed_weight(lin2) is not None
    with torch.no_grad():
        torch.testing.assert_close(dup(x), lin2(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_keeps_gradients_when_training():
    lin = torch.nn.Linear(16, 8)
    pack_linears(lin)
    lin(torch.randn(5, 16)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


@needs_onednn
@pytest.mark.parametrize("rows", [2, 5, 9])
def test_project_with_a_packed_head_is_the_same_product(rows):
    head = torch.nn.Linear(16, 300, bias=False)
    x = torch.randn(rows, 16)
    ref = torch.nn.functional.linear(x, head.weight)
    cpu_decode_layout(torch.nn.ModuleDict({"lm_head": head}))
    assert packed_weight(head) is not None
    torch.testing.assert_close(project(head, x), ref, rtol=1e-5, atol=1e-5)
