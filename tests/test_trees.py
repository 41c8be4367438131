"""Tree shapes, tree attention through the public forward, and tree growth."""

import pytest
import torch

from draftsmith.engine.drafting import GrowContext, grow_dynamic, grow_static
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.trees import DraftTree, DynamicTree, StaticTree, chain_paths, validate_paths
from draftsmith.engine.cache_kw import cache_arg
from tests.tiny import make_tiny_model


def test_validate_paths_accepts_and_sorts():
    t = StaticTree([(0, 0), (0,), (1,), (0, 1), (0, 0, 0)])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.depth == 3 and t.size == 5
    assert chain_paths(3) == [(0,), (0, 0), (0, 0, 0)]


@pytest.mark.parametrize("paths, bad", [
    ([(0,), (0, 1)], r"\(0, 1\)"),  # sibling rank 0 missing
    ([(0,), (1, 0)], r"\(1, 0\)"),  # parent (1,) missing
    ([(0,), (-1,)], r"\(-1,\)"),  # negative rank
    ([(0,), (0,)], r"\(0,\)"),  # duplicate
    ([(0,), ()], r"empty"),
    ([(0,), (0.5,)], r"\(0.5,\)"),
    ([], r"at least one path"),
])
def test_validate_paths_errors_name_the_path(paths, bad):
    with pytest.raises(ValueError, match=bad):
        validate_paths(paths)


def test_static_tree_deeper_than_drafter():
    t = StaticTree(chain_paths(3))
    t.check_depth(3)
    with pytest.raises(ValueError, match=r"\(0, 0, 0\).*at most 2"):
        t.check_depth(2)


def _tree(parents, tokens):
    tr = DraftTree(tokens[0], len(parents), "cpu")
    for p, t in zip(parents, tokens[1:]):
        tr.add(p, t)
    return tr


def test_ancestor_mask_and_paths():
    tr = _tree([0, 0, 1, 3], [5, 6, 7, 8, 9])
    m = tr.ancestor_mask("cpu").int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert tr.path(4) == [0, 1, 3, 4] and tr.depth == [0, 1, 1, 2, 3] and tr.rank == [0, 0, 1, 0, 0]
    assert tr.children[0] == [1, 2] and not tr.is_chain()
    assert _tree([0, 1], [1, 2, 3]).is_chain()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_attention_through_public_forward(impl):
    """One tree forward (4D float mask, depth positions, KVCache) equals separate full forwards per path."""
    model = make_tiny_model(vocab_size=40, init_std=0.5, seed=1)
    model.config._attn_implementation = impl
    prefix = [1, 5, 9, 3, 7]
    tr = _tree([0, 0, 1, 1, 2, 4], [12, 20, 21, 30, 31, 32, 33])  # root 12 at slot/pos 5
    cache = KVCache.for_model(model, 32)
    body = model.get_decoder()
    with torch.no_grad():
        body(input_ids=torch.tensor([prefix]), position_ids=torch.arange(5)[None],
             **cache_arg(body, cache.set_write(0)), use_cache=True)
        mask = prefix_block_mask(5, tr.ancestor_mask("cpu"), torch.float32)
        h = body(input_ids=tr.tokens()[None], position_ids=(5 + torch.tensor(tr.depth))[None], attention_mask=mask,
                 **cache_arg(body, cache.set_write(5)), use_cache=True).last_hidden_state[0]
        got = model.lm_head(h)
        toks = tr.tokens().tolist()
        for i in range(tr.n + 1):
            seq = prefix + [toks[j] for j in tr.path(i)]
            ref = model(torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(got[i], ref, atol=1e-4), (impl, i)
        assert mask.dtype == torch.float32 and mask.shape == (1, 1, 7, 12)
        # A bool mask works with sdpa but eager attention adds it to the scores as 0/1, ignoring the tree:
        # hence the additive float mask, which both honour.
        hb = body(input_ids=tr.tokens()[None], position_ids=(5 + torch.tensor(tr.depth))[None],
                  attention_mask=(mask == 0), **cache_arg(body, cache.set_write(5)),
                  use_cache=True).last_hidden_state[0]
        assert torch.allclose(model.lm_head(hb), got, atol=1e-4) == (impl == "sdpa")


def test_compact_moves_accepted_entries():
    model = make_tiny_model(vocab_size=40, seed=2)
    cache = KVCache.for_model(model, 16)
    for layer in cache.layers:
        layer.keys.copy_(torch.arange(16.0).view(1, 1, 16, 1).expand_as(layer.keys))
    cache.compact([7, 9, 10], 5)
    assert cache.layers[0].keys[0, 0, :11, 0].tolist() == [0, 1, 2, 3, 4, 7, 9, 10, 8, 9, 10]
    cache.compact([6, 7], 6)  # already in place: no-op
    assert cache.layers[1].values.abs().sum() == 0


def _ctx(logits_for_node, sampling, cap, rng=None):
    return GrowContext(propose=lambda t, s, e: torch.stack([logits_for_node(t, i) for i in range(s, e)]),
                       sampling=sampling, ranked=sampling.greedy, rng=rng or TorchRandom(0), eos=frozenset(),
                       depth_cap=cap)


def test_grow_static_greedy_ranks():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])  # ranking: 1, 3, 2, 0, 4
    tr = DraftTree(0, 8, "cpu")
    grow_static(tr, _ctx(lambda t, i: logits, SamplingParams(), cap=5),
                StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]))
    assert tr.tokens().tolist() == [0, 1, 3, 2, 1, 3, 1]
    assert tr.parent == [-1, 0, 0, 0, 1, 1, 2]
    # the depth cap (room left before max_new_tokens) prunes deeper paths
    tr = DraftTree(0, 8, "cpu")
    grow_static(tr, _ctx(lambda t, i: logits, SamplingParams(), cap=1), StaticTree([(0,), (1,), (0, 0)]))
    assert tr.n == 2


def test_grow_static_sampling_drops_ranks_beyond_support():
    logits = torch.tensor([0.0, 3.0, -float("inf"), -float("inf")])
    tr = DraftTree(0, 8, "cpu")
    grow_static(tr, _ctx(lambda t, i: logits, SamplingParams(1.0), cap=3), StaticTree([(0,), (1,), (2,), (1, 0)]))
    assert sorted(tr.tokens().tolist()[1:3]) == [0, 1] and tr.n == 3  # rank 2 has no token left
    assert set(tr.q) == {0, 2}


def test_grow_dynamic_budget_depth_and_values():
    # Confidence: token 1 (.7), token 2 (.2), ... at every node; best-first keeps the most probable paths.
    probs = torch.tensor([0.04, 0.7, 0.2, 0.06])
    tr = DraftTree(0, 16, "cpu")
    grow_dynamic(tr, _ctx(lambda t, i: probs.log(), SamplingParams(), cap=3),
                 DynamicTree(budget=5, max_depth=3, width=2, expand_batch=1))
    # values: (1)=.7, (1,1)=.49, (1,1,1)=.343, (2)=.2, (1,2)=.14, (2,1)=.14 -> the budget of 5 takes the top 5
    # (ties broken by creation order: (1,2) was queued before (2,1)).
    paths = sorted(tuple(tr.tokens()[tr.path(i)].tolist()[1:]) for i in range(1, tr.n + 1))
    assert paths == [(1,), (1, 1), (1, 1, 1), (1, 2), (2,)]
    assert max(tr.depth) == 3 and tr.n == 5
    tr = DraftTree(0, 16, "cpu")
    grow_dynamic(tr, _ctx(lambda t, i: probs.log(), SamplingParams(), cap=1),
                 DynamicTree(budget=5, max_depth=3, width=2))
    assert tr.n == 2 and max(tr.depth) == 1


def test_dynamic_tree_config_validation():
    with pytest.raises(ValueError):
        DynamicTree(budget=0)
