"""Exact 4-bit and 8-bit copies of float32 weights (engine/blockquant.py) and their kernel (csrc/rows_linear_q.cpp).

A weight dequantised from a GGUF file's Q4_1 or Q8_0 blocks is found exactly (every block reproduced bit for
bit) and nothing else is; the packed kernel gives the float32 kernel's bits for every row count; a decoding
forward over packed weights gives the float32 forward's logits bit for bit, and the decoder over it stays
lossless (exact enumeration) and equal to plain decoding (greedy)."""

import pytest
import torch

from draftsmith.engine import blockquant
from draftsmith.engine.native import rows_linear_on

native = pytest.mark.skipif(not rows_linear_on(), reason="native kernels unavailable or DRAFTSMITH_ROWS_LINEAR=0")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_dequantised_weight_packs_exactly_and_a_float_one_does_not(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(48, 96, generator=g) * 0.05
    w[3, :32] = 0.25  # a constant block (scale 0)
    wq = blockquant.quantize(w, bits)
    p = blockquant.pack(wq, bits)
    assert p is not None and p.bits == bits
    assert torch.equal(_bits(blockquant.unpack(p)), _bits(wq))
    assert p.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert p.nbytes < wq.numel() * 4 * (0.2 if bits == 4 else 0.33)
    assert blockquant.pack(w, bits) is None  # random float32 numbers are no grid
    wq2 = wq.clone()
    wq2[7, 40] = torch.nextafter(wq2[7, 40], torch.tensor(1.0))  # one weight one ulp off the grid
    assert blockquant.pack(wq2, bits) is None
    assert blockquant.pack(wq[:, :40], bits) is None  # not whole blocks
    if bits == 8:  # a 4-bit grid is also an 8-bit... only where the offset is 0; the 4-bit one has an offset
        assert blockquant.pack(blockquant.quantize(w, 4), 8) is None


@pytest.mark.parametrize("fmt", ["q5_0", "q4_0"])
def test_symmetric_5_and_4_bit_blocks_pack_at_8_bits_beside_8_bit_ones(fmt):
    """A "Q4_K_M" file holds most matrices as Q5_0 and some as Q8_0 (one layer's v projection, the head): each
    block is found at 8 bits whatever its own format, and a weight whose rows mix the two packs exactly."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 128, generator=g) * 0.05
    ws = blockquant.quantize(w, 8, fmt)
    assert not torch.equal(ws, w) and blockquant.pack(ws, 4) is None
    mixed = torch.cat([ws[:8], blockquant.quantize(w[8:], 8)])
    for x in (ws, mixed):
        p = blockquant.pack(x, 8)
        assert p is not None and torch.equal(_bits(blockquant.unpack(p)), _bits(x))
    off = ws.clone()
    off[2, 70] = torch.nextafter(off[2, 70], torch.tensor(1.0))
    assert blockquant.pack(off, 8) is None


def test_pack_refuses_other_bit_widths():
    with pytest.raises(ValueError, match="4 or 8 bits"):
        blockquant.pack(torch.zeros(4, 32), 3)


@native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(576, 576), (100, 1536), (7, 32), (130, 96)])
def test_the_packed_kernel_gives_the_float32_kernels_bits(bits, n, k):
    g = torch.Generator().manual_seed(n + k + bits)
    w = blockquant.quantize(torch.randn(n, k, generator=g) * 0.05, bits)
    p = blockquant.pack(w, bits)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            want = torch.ops.draftsmith_native.rows_linear(x, w, bias)
            got = torch.ops.draftsmith_native.rows_linear_q(x, p.q, p.d, p.m, bits, bias)
            assert torch.equal(_bits(got), _bits(want)), (m, float((got - want).abs().max()))


@native
def test_negative_zero_weights_pack_and_give_the_float32_kernels_bits():
    """ggml's symmetric formats dequantise q - 16 = 0 with a negative scale to -0.0; packed, that weight is +0.0.
    The outputs are still the float32 kernel's on the weights as stored, bit for bit, whatever the signs of the
    inputs, including rows that are all zero (no sum of products can become -0.0)."""
    g = torch.Generator().manual_seed(11)
    w = blockquant.quantize(torch.randn(64, 96, generator=g) * 0.05, 8, "q5_0")
    w[w == 0] = -0.0
    w[5] = -0.0  # a whole row of negative zeros
    assert (w == 0).sum() > 64 and torch.signbit(w[w == 0]).all()
    p = blockquant.pack(w, 8)
    assert p is not None
    for m in (1, 3, 8):
        x = torch.randn(m, 96, generator=g)
        x[0, :40] = -0.0
        want = torch.ops.draftsmith_native.rows_linear(x, w, None)
        got = torch.ops.draftsmith_native.rows_linear_q(x, p.q, p.d, p.m, 8, None)
        assert torch.equal(_bits(got), _bits(want)), m
        assert not torch.signbit(got[:, 5]).any()


@native
def test_the_packed_kernel_names_bad_shapes():
    w = blockquant.quantize(torch.randn(8, 64) * 0.05, 4)
    p = blockquant.pack(w, 4)
    with pytest.raises(RuntimeError, match="64 inputs|inputs against packed"):
        torch.ops.draftsmith_native.rows_linear_q(torch.randn(1, 96), p.q, p.d, p.m, 4, None)
    with pytest.raises(RuntimeError, match="4 or 8 bits"):
        torch.ops.draftsmith_native.rows_linear_q(torch.randn(1, 64), p.q, p.d, p.m, 5, None)
    with pytest.raises(RuntimeError, match="float32 inputs"):
        torch.ops.draftsmith_native.rows_linear_q(torch.randn(1, 64).double(), p.q, p.d, p.m, 4, None)


def _packed_tiny(vocab=96, layers=2, seed=0, std=0.3):
    """A tiny float32 target whose matrices are Q4_1 blocks and whose tied embedding is Q8_0, as the default
    target's GGUF file stores them."""
    from tests.tiny import make_tiny_target
    t = make_tiny_target(vocab_size=vocab, seed=seed, init_std=std, layers=layers)
    with torch.no_grad():
        for name, p in t.model.named_parameters():
            if p.dim() == 2:
                p.copy_(blockquant.quantize(p, 8 if "embed" in name else 4))
    return t


@native
def test_a_forward_over_packed_weights_is_the_float32_forwards_bit_for_bit():
    from draftsmith.engine.fastpath import FastBody
    from draftsmith.engine.kvcache import KVCache, prefix_block_mask
    tgt = _packed_tiny()
    packed, plain = FastBody(tgt.model, compile=False), FastBody(tgt.model, compile=False, pack=False)
    assert packed.packed == {"qkv": 4, "o": 4, "gate_up": 4, "down": 4, "head": 8} and plain.packed == {}
    outs = []
    for fast in (packed, plain):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 96, (1, 20), generator=g)
        c = KVCache.for_model(tgt.model, 64)
        c.set_write(0)
        with torch.no_grad():
            a = fast(input_ids=ids, cache=c).logits  # 20 rows: the float32 BLAS product in both
            got = [a]
            for q in (1, 4):  # a plain step, and a 4-row tree block whose rows 1 and 2 are siblings
                blk = torch.ones(q, q, dtype=torch.bool).tril()
                if q == 4:
                    blk[2, 1] = False
                c.set_write(20)
                x = torch.randint(3, 96, (1, q), generator=g)
                got.append(fast(input_ids=x, position_ids=torch.arange(20, 20 + q)[None],
                                attention_mask=prefix_block_mask(20, blk, torch.float32), cache=c).logits)
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(_bits(a), _bits(b))


@native
def test_a_target_with_one_inexact_weight_keeps_that_group_in_float32():
    from draftsmith.engine.fastpath import FastBody
    tgt = _packed_tiny()
    with torch.no_grad():
        w = tgt.model.model.layers[1].mlp.down_proj.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
    assert FastBody(tgt.model, compile=False).packed == {"qkv": 4, "o": 4, "gate_up": 4, "head": 8}


@native
def test_decoding_over_packed_weights_is_lossless():
    """Exact enumeration on a 6-token packed target: the decoder's distribution through the packed forward
    equals the target's own (float32 arithmetic: within float32 rounding), and greedy decoding with a drafter
    equals plain decoding token for token."""
    from draftsmith.engine.decoder import SpeculativeDecoder
    from draftsmith.engine.fastpath import use_fast_forward
    from draftsmith.engine.policies import FixedLength
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
    from tests.test_decoder import other_model_drafter, random_medusa

    tgt = _packed_tiny(vocab=6, std=0.5)
    ref = target_distribution(tgt, [1, 3, 4, 3], 3, 0.8)
    use_fast_forward(tgt, "fast")
    assert tgt.fast_body.packed["head"] == 8
    dec = SpeculativeDecoder(tgt, other_model_drafter(tgt), sampling=SamplingParams(0.8), policy=FixedLength(2))
    assert dec.fast is tgt.fast_body
    got = exact_distribution(dec, [1, 3, 4, 3], 3)
    assert total_variation(got, ref) < 1e-5

    big = _packed_tiny(vocab=96, std=0.3, layers=2)
    use_fast_forward(big, "fast")
    prompt = [1, 5, 9, 14, 3, 7]
    plain = SpeculativeDecoder(big).generate(prompt, 40).tokens
    spec = SpeculativeDecoder(big, random_medusa(big)).generate(prompt, 40).tokens
    assert list(spec) == list(plain) and len(plain) > 20
