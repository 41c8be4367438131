"""Exact 4-bit and 8-bit copies of float32 weights (engine/blockquant.py) and their kernel (csrc/rows_linear_q.cpp).

A weight dequantised from a GGUF file's Q4_1 or Q8_0 blocks is found exactly (every block reproduced bit for
bit) and nothing else is; the packed kernel gives the float32 kernel's bits for every row count; a decoding
forward over packed weights gives the float32 forward's logits bit for bit, and the decoder over it stays
lossless (exact enumeration) and equal to plain decoding (greedy)."""

import numpy as np
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
    with pytest.raises(RuntimeError, match="4, 6 or 8 bits"):
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


def _q4_k_bytes(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K super-blocks ([n, k / 256 * 144] uint8): fp16 d and dmin, 12 bytes of 6-bit scales and mins,
    128 bytes of nibbles (ggml's block_q4_K)."""
    rng = np.random.default_rng(seed)
    s = n * k // 256
    b = np.zeros((s, blockquant.Q4_K_BYTES), np.uint8)
    b[:, 0:2] = (rng.uniform(1e-4, 2e-3, s).astype(np.float16).view(np.uint8).reshape(s, 2))
    b[:, 2:4] = (rng.uniform(1e-4, 2e-3, s).astype(np.float16).view(np.uint8).reshape(s, 2))
    b[:, 4:] = rng.integers(0, 256, (s, 140), dtype=np.uint8)
    return b.reshape(n, -1)


def test_q4_k_tensors_read_from_their_bytes_are_ggufs_own_dequantisation():
    """`from_q4_k` turns a GGUF Q4_K tensor's bytes into 4-bit blocks of 32 whose fma(D, q, M) is, bit for bit, what
    the gguf package's own dequantiser gives (the float32 weights a target converted from the file holds), and the
    packed kernel multiplies by them with the float32 kernel's bits."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    n, k = 24, 512
    raw = _q4_k_bytes(n, k)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float32)).reshape(n, k)
    p = blockquant.from_q4_k(raw, n, k)
    assert p.bits == 4 and p.q.shape == (n, k // 2) and p.d.shape == (n, k // 32)
    assert blockquant.exact_for(p, want)
    assert not blockquant.exact_for(p, want * 1.0001)
    with pytest.raises(ValueError, match="Q4_K"):
        blockquant.from_q4_k(raw[:, :-1], n, k)
    if rows_linear_on():
        x = torch.randn(3, k)
        assert torch.equal(_bits(torch.ops.draftsmith_native.rows_linear_q(x, p.q, p.d, p.m, 4, None)),
                           _bits(torch.ops.draftsmith_native.rows_linear(x, want.contiguous(), None)))


def _q6_k_bytes(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K super-blocks ([n, k / 256 * 210] uint8): 192 bytes of 6-bit values, 16 int8 scales, fp16 d of
    either sign (ggml's block_q6_K)."""
    rng = np.random.default_rng(seed)
    s = n * k // 256
    b = rng.integers(0, 256, (s, blockquant.Q6_K_BYTES), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-3, s) * rng.choice([-1.0, 1.0], s)
    b[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(s, 2)
    return b.reshape(n, -1)


def test_q6_k_tensors_read_from_their_bytes_are_ggufs_own_dequantisation():
    """`from_q6_k` turns a GGUF Q6_K tensor's bytes into int8 weights with a scale per 16 whose products are, bit for
    bit (zeros of either sign alike), the gguf package's own dequantisation, and the packed kernel's 6-bit mode
    multiplies by them with the float32 kernel's bits, for 1 to 16 rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    n, k = 40, 768
    raw = _q6_k_bytes(n, k)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float32)).reshape(n, k)
    p = blockquant.from_q6_k(raw, n, k)
    assert p.bits == 6 and p.q.shape == (n, k) and p.d.shape == (n, k // 16)
    assert int(p.q.min()) == -32 and int(p.q.max()) == 31
    assert blockquant.exact_for(p, want)
    assert not blockquant.exact_for(p, want.roll(1, dims=1))  # the weights' order matters
    with pytest.raises(ValueError, match="Q6_K"):
        blockquant.from_q6_k(raw[:, :-1], n, k)
    if rows_linear_on():
        for rows in (1, 3, 8, 16):
            x = torch.randn(rows, k)
            assert torch.equal(_bits(torch.ops.draftsmith_native.rows_linear_q(x, p.q, p.d, p.m, 6, None)),
                               _bits(torch.ops.draftsmith_native.rows_linear(x, want.contiguous(), None))), rows


@native
def test_a_group_packed_in_part_keeps_its_other_weights_in_float32(monkeypatch):
    """A group whose weights are packed only in part (Q4_K down projections beside Q6_K ones, in the named
    targets' files): the packed ones are multiplied from their blocks, the others from float32, and the forward is
    still the float32 forward's, bit for bit."""
    from draftsmith.engine import fastpath
    from draftsmith.engine.fastpath import FastBody
    from draftsmith.engine.kvcache import KVCache
    tgt = _packed_tiny()
    with torch.no_grad():  # layer 1's down projection off the grid: the group does not pack from float32 values
        w = tgt.model.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * 1e-3)

    def from_file(self, groups, done):  # as if the file held layer 0's down projection as Q4_K
        assert "down" in groups and "down" not in done
        keep = blockquant.pack(groups["down"][0], 4)
        return {"down": [keep, blockquant.Packed(torch.zeros(0, dtype=torch.uint8), torch.zeros(0), torch.zeros(0),
                                                 0)]}

    monkeypatch.setattr(fastpath._Core, "_k_quant_packs", from_file)
    packed = FastBody(tgt.model, compile=False)
    plain = FastBody(tgt.model, compile=False, pack=False)
    assert packed.packed["down"] == 4 and packed.packed["qkv"] == 4
    assert plain.step_bytes() > packed.step_bytes() > plain.step_bytes() - sum(
        p.numel() * 4 for p in tgt.model.parameters() if p.dim() == 2)
    outs = []
    for fast in (packed, plain):
        c = KVCache.for_model(tgt.model, 64)
        c.set_write(0)
        with torch.no_grad():
            fast(input_ids=torch.arange(3, 23)[None], cache=c)
            c.set_write(20)
            outs.append(fast(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[20]]), cache=c).logits)
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
