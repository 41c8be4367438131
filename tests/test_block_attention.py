"""The native attention for a speculative block (``draftsmith_native::block_attention``): a chain's or a tree's
queries in one cache row, each seeing the slots before the block and the block slots its mask allows. Against
masked SDPA; a chain's row bit for bit what the 1-row decode kernel computes for the same query (so verifying a
chain gives plain decoding's logits); and the decoding forward through it against the masked-SDPA forward."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.engine.native import block_for, native_for, ragged_block_attention

pytestmark = pytest.mark.skipif(native_for(torch.float32, "cpu", 64) is None, reason="native kernels unavailable")


def _tree_mask(b: int, g: torch.Generator) -> torch.Tensor:
    """A random tree over b block slots: slot 0 the root, each later slot a child of a random earlier one."""
    allow = torch.eye(b, dtype=torch.bool)
    for j in range(1, b):
        p = int(torch.randint(0, j, (1,), generator=g))
        allow[j] |= allow[p]
    return allow


def _reference(q, k, v, s, allow, scale):
    b = q.shape[0]
    see = torch.zeros(b, s + b, dtype=torch.bool)
    see[:, :s] = True
    see[:, s:] = allow
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:, :, :s + b], v[:, :, :s + b],
                                         attn_mask=see, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s", [(1, 7), (4, 33), (8, 100), (16, 5)])
def test_block_attention_equals_masked_sdpa(b, s, dtype):
    g = torch.Generator().manual_seed(b * 100 + s)
    H, KV, D, C = 9, 3, 64, 160
    q = torch.randn(b, H, D, generator=g).to(dtype)
    k, v = (torch.randn(1, KV, C, D, generator=g).to(dtype) for _ in range(2))
    allow = _tree_mask(b, g)
    op = block_for(dtype, "cpu", D)
    got = op(q, k, v, torch.arange(s, s + b), allow, D ** -0.5)
    want = _reference(q.float(), k.float(), v.float(), s, allow, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max() < tol


@pytest.mark.parametrize("contiguous", [True, False], ids=["native", "sdpa"])
def test_ragged_blocks_each_attend_to_their_own_row(contiguous):
    """`ragged_block_attention` (a batched verification): blocks of different widths (one of a single token) of
    rows at different lengths, one flat run without padding, in cache rows given out of order, each equal to its
    own row's masked SDPA (the native kernel where the cache's slots are contiguous, one SDPA call per block
    otherwise)."""
    g = torch.Generator().manual_seed(11)
    H, KV, D, C, m = 9, 3, 64, 96, 5
    widths, rows, starts = [5, 1, 3], torch.tensor([2, 0, 3]), [40, 7, 81]
    T = sum(widths)
    q = torch.randn(T, H, D, generator=g)
    k, v = (torch.randn(4, KV, C, D, generator=g) for _ in range(2))
    if not contiguous:  # the same numbers, slots no longer contiguous: the SDPA path
        k, v = (x.transpose(2, 3).contiguous().transpose(2, 3) for x in (k, v))
    bounds = torch.tensor([0, 5, 6, 9])
    last = torch.cat([torch.arange(s, s + w) for s, w in zip(starts, widths)])
    allow = torch.stack([_tree_mask(m, g) for _ in range(3)])
    got = ragged_block_attention(q, k, v, rows, bounds, last, allow, D ** -0.5)
    for i, (r, s, w) in enumerate(zip(rows.tolist(), starts, widths)):
        a = int(bounds[i])
        want = _reference(q[a:a + w], k[r:r + 1], v[r:r + 1], s, allow[i, :w, :w], D ** -0.5)
        assert (got[a:a + w] - want).abs().max() < 1e-5


def test_a_chain_row_is_the_one_query_kernels_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    b, s, H, KV, D, C = 8, 41, 9, 3, 64, 128
    q = torch.randn(b, H, D, generator=g)
    k, v = (torch.randn(1, KV, C, D, generator=g) for _ in range(2))
    last = torch.arange(s, s + b)
    block = block_for(torch.float32, "cpu", D)(q, k, v, last, torch.ones(b, b, dtype=torch.bool).tril(), D ** -0.5)
    one = native_for(torch.float32, "cpu", D)
    for i in range(b):
        alone = one(q[i:i + 1], k, v, last[i:i + 1], D ** -0.5)
        assert torch.equal(alone[0], block[i])


def test_block_attention_names_a_query_outside_its_block():
    op = block_for(torch.float32, "cpu", 64)
    q, k = torch.randn(2, 9, 64), torch.randn(1, 3, 32, 64)
    with pytest.raises(RuntimeError, match="outside its block"):
        op(q, k, k, torch.tensor([5, 9]), torch.ones(2, 2, dtype=torch.bool), 0.125)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_forward_through_the_block_kernel_equals_the_masked_one(tree):
    from draftsmith.engine.fastpath import FastBody
    from draftsmith.engine.kvcache import KVCache, prefix_block_mask
    from tests.tiny import make_tiny_target
    tgt = make_tiny_target(vocab_size=96, init_std=0.3, layers=2, hidden_size=128, heads=4, kv_heads=2)
    outs = []
    for native in (True, False):
        fast = FastBody(tgt.model, compile=False)
        fast.block_native = native
        assert fast.core.attend_block is not None  # head size 32: the kernel applies on every vector width
        g = torch.Generator().manual_seed(0)
        c = KVCache.for_model(tgt.model, 64)
        c.set_write(0)
        with torch.no_grad():
            fast(input_ids=torch.randint(3, 96, (1, 13), generator=g), cache=c)
            blk = _tree_mask(5, g) if tree else torch.ones(5, 5, dtype=torch.bool).tril()
            pos = 13 + blk.sum(1)[None] - 1  # each slot's depth in the tree after the prefix
            c.set_write(13)
            out = fast(input_ids=torch.randint(3, 96, (1, 5), generator=g), position_ids=pos,
                       attention_mask=prefix_block_mask(13, blk, torch.float32), cache=c)
        outs.append((out.logits, c.layers[0].keys[:, :, :18].clone()))
    assert (outs[0][0] - outs[1][0]).abs().max() < 1e-4
    assert torch.equal(outs[0][1], outs[1][1])
