"""The native linear for a decoding step's few rows: y = x W^T + b against float64, the same bits for a row whatever
rows are beside it, bfloat16 as the float32 kernel on the widened numbers rounded once (or, in the AVX512_BF16
build, VDPBF16PS's pairs within float32's accumulation error), and F.linear everywhere it does not apply."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.engine import native
from draftsmith.engine.native import ROWS_LINEAR_MAX, decode_linear, rows_linear_dtypes, rows_linear_on

pytestmark = pytest.mark.skipif(not rows_linear_on(), reason="native kernels unavailable or DRAFTSMITH_ROWS_LINEAR=0")

# (out, in): a head-like matrix, the target's MLP shapes, and odd sizes whose tails the vector loop does not cover
SHAPES = [(4096, 576), (1536, 576), (576, 1536), (7, 13), (100, 37), (65, 24), (3, 8), (5, 1)]


def _op(x, w, b=None):
    return torch.ops.draftsmith_native.rows_linear(x, w, b)


def _widened(x, w, b=None):
    return torch.ops.draftsmith_native.rows_linear_widened(x, w, b)


def _bf16_bound(x, w, b, ref):
    """Half a bf16 unit of the float64 product plus float32's accumulation error of its terms."""
    return (2.0 ** -8 * ref.abs() + 8 * torch.finfo(torch.float32).eps
            * (F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 37])
def test_rows_linear_equals_the_product_in_float64(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    ref = F.linear(x.double(), w.double(), b.double())
    # float32 dot products of k terms: error within a few ulp of the sum of |terms| per element
    bound = 8 * torch.finfo(torch.float32).eps * (F.linear(x.double().abs(), w.double().abs()) + b.double().abs())
    for bias in (b, None):
        got = _op(x, w, bias).double()
        want = ref if bias is not None else ref - b.double()
        assert got.shape == (m, n)
        assert bool(((got - want).abs() <= bound + 1e-30).all()), float((got - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(n, k, dtype):
    """Verification's logits for a row equal plain decoding's for the same input, bit for bit; and a prompt's rows
    (many, multiplied block by block) equal the same rows multiplied alone."""
    g = torch.Generator().manual_seed(n + k)
    m = 45  # several groups of four rows, and a last group of one
    x, w, b = (t.to(dtype) for t in (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g),
                                     torch.randn(n, generator=g)))
    together = _op(x, w, b)
    for r in range(m):
        assert torch.equal(_op(x[r:r + 1], w, b)[0], together[r])
        assert torch.equal(_op(x[r:r + 3], w, b)[0], together[r])
    assert torch.equal(_op(x[:ROWS_LINEAR_MAX], w, b), together[:ROWS_LINEAR_MAX])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_prefetch_changes_no_bit_and_is_set_per_process(dtype):
    """The kernel asks for the weight rows a few KB ahead (into L2) where a group has enough rows to need it; it
    is a hint, so every setting gives the same bits, including a distance past the last row and a row longer
    than the distance; the setting round-trips and a bad one is refused."""
    g = torch.Generator().manual_seed(7)
    before = native.set_prefetch_bytes(native.PREFETCH_BYTES)
    try:
        for n, k in [(4096, 576), (300, 1536), (65, 24), (5, 1)]:
            x, w, b = (t.to(dtype) for t in (torch.randn(16, k, generator=g), torch.randn(n, k, generator=g),
                                             torch.randn(n, generator=g)))
            outs = {}
            for ahead in (0, 64, native.PREFETCH_BYTES, 1 << 20):
                native.set_prefetch_bytes(ahead)
                outs[ahead] = [_op(x[:m], w, b) for m in (1, 2, 3, 4, 5, 8, 16)]
                outs[ahead].append(_widened(x[:6], w, b))
            for ahead, got in outs.items():
                assert all(torch.equal(a, r) for a, r in zip(got, outs[0])), (n, k, ahead)
        assert native.set_prefetch_bytes(123) == 1 << 20
        assert native.set_prefetch_bytes(native.PREFETCH_BYTES) == 123
        with pytest.raises(RuntimeError, match="set_prefetch_bytes"):
            native.set_prefetch_bytes(-1)
        with pytest.raises(ValueError, match="DRAFTSMITH_PREFETCH_BYTES"):
            native._prefetch_env("4k")
        assert native._prefetch_env("0") == 0
    finally:
        native.set_prefetch_bytes(before)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 4, 8, 37])
def test_bf16_is_the_float32_kernel_on_the_widened_numbers_rounded_once(m, n, k):
    """bf16 weights and inputs are widened exactly, multiplied and summed in float32 by the same chain as the float32
    kernel, the bias added in float32, and the result rounded once: bit for bit that chain, and within float32's
    accumulation error plus half a bf16 unit of the float64 product. That is `rows_linear` itself in a build without
    AVX512_BF16, and ``rows_linear_widened`` in every build."""
    g = torch.Generator().manual_seed(7 * m + n + k)
    x, w, b = (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16(),
               torch.randn(n, generator=g).bfloat16())
    ops = [_widened] + ([] if native.native_status()["bf16_dot"] else [_op])
    for op in ops:
        for bias in (b, None):
            got = op(x, w, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            f32 = _op(x.float(), w.float(), None if bias is None else bias.float())
            assert torch.equal(got, f32.bfloat16())
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert bool(((got.double() - ref).abs() <= _bf16_bound(x, w, bias, ref) + 1e-30).all())
        together = op(x, w, b)
        for r in range(m):  # row-independence holds in bf16 too
            assert torch.equal(op(x[r:r + 1], w, b)[0], together[r])


@pytest.mark.skipif(not native.native_status()["bf16_dot"], reason="the kernels' build has no AVX512_BF16 here")
@pytest.mark.parametrize("n,k", SHAPES + [(96, 100), (40, 64), (33, 96)])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_bf16_by_the_cpus_dot_product_is_within_float32_accumulation_of_the_exact_product(m, n, k):
    """The AVX512_BF16 build multiplies bf16 pairs by VDPBF16PS: within float32's accumulation error plus half a
    bf16 unit of the float64 product, a row's bits whatever rows are beside it, and not the widened chain's bits
    everywhere (so the test sees which path ran). Shapes cover 64-number blocks, a last odd 32 and the tails."""
    g = torch.Generator().manual_seed(11 * m + n + k)
    x, w, b = (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16(),
               torch.randn(n, generator=g).bfloat16())
    for bias in (b, None):
        got = _op(x, w, bias)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert bool(((got.double() - ref).abs() <= _bf16_bound(x, w, bias, ref) + 1e-30).all())
    together = _op(x, w, b)
    for r in range(m):
        assert torch.equal(_op(x[r:r + 1], w, b)[0], together[r])


def test_the_bf16_dot_product_path_runs_in_its_build():
    """Where the build has AVX512_BF16, `rows_linear` differs somewhere from the widened chain on a big product (the
    pairs round differently), so the routing to VDPBF16PS is seen; elsewhere the two are one chain."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 576, generator=g).bfloat16(), torch.randn(4096, 576, generator=g).bfloat16()
    same = torch.equal(_op(x, w), _widened(x, w))
    assert same == (not native.native_status()["bf16_dot"])


def test_the_kernel_refuses_mixed_or_other_dtypes():
    w = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _op(torch.randn(2, 8).bfloat16(), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _op(torch.randn(2, 8).half(), w.half())


def test_leading_dimensions_and_a_non_contiguous_input_keep_their_shape():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(1, 3, 48, generator=g)[..., ::2]  # strided last dimension
    got = _op(x, w)
    assert got.shape == (1, 3, 40)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_decode_linear_routes_only_what_the_kernel_serves(monkeypatch):
    calls = []
    real = torch.ops.draftsmith_native.rows_linear

    class Spy:
        @staticmethod
        def rows_linear(*a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(torch.ops, "draftsmith_native", Spy)
    w = torch.randn(16, 8)
    decode_linear(torch.randn(ROWS_LINEAR_MAX, 8), w)
    assert len(calls) == 1
    decode_linear(torch.randn(ROWS_LINEAR_MAX + 1, 8), w)  # more rows: the BLAS product
    decode_linear(torch.randn(2, 8), w, native=False)  # the caller turned it off
    decode_linear(torch.randn(2, 8, dtype=torch.float16), w.half())  # another dtype
    decode_linear(torch.randn(2, 8, requires_grad=True), w)  # gradients: the kernel has no backward
    assert len(calls) == 1
    # bf16: the kernel except with AMX; a prompt's rows too where the CPU has no bf16 instructions (AVX512_BF16)
    decode_linear(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16())
    decode_linear(torch.randn(3 * ROWS_LINEAR_MAX, 8, dtype=torch.bfloat16), w.bfloat16())
    bf16 = torch.bfloat16 in rows_linear_dtypes()
    assert len(calls) == 1 + bf16 + (bf16 and not native._CPU_BF16)


def test_bf16_goes_to_the_kernel_by_the_cpus_bf16_instructions(monkeypatch):
    """No bf16 instructions: any rows; AVX512_BF16 without AMX: up to ROWS_LINEAR_MAX rows; AMX: none (oneDNN)."""
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    many = torch.randn(ROWS_LINEAR_MAX + 1, 8)
    for has_bf16, has_amx, few, lots in ((False, False, True, True), (True, False, True, False),
                                         (True, True, False, False)):
        monkeypatch.setattr(native, "_CPU_BF16", has_bf16)
        monkeypatch.setattr(native, "_CPU_AMX", has_amx)
        assert rows_linear_dtypes() == ({torch.float32} if has_amx else {torch.float32, torch.bfloat16})
        assert native.rows_linear_applies(x, w) == few
        assert native.rows_linear_applies(x[:1].expand(ROWS_LINEAR_MAX, 8).contiguous(), w) == few
        assert native.rows_linear_applies(many.bfloat16(), w) == lots
        assert native.rows_linear_applies(x.float(), w.float())
        assert not native.rows_linear_applies(many, w.float())  # float32: BLAS past ROWS_LINEAR_MAX


def test_the_kernel_is_one_node_in_a_compiled_graph():
    """A compiled decoding step calls the kernel (its fake gives the shape): same values as eager."""
    w = torch.randn(32, 16)

    def f(x):
        return decode_linear(torch.relu(x), w) * 2

    x = torch.randn(1, 3, 16)
    got = torch.compile(f, dynamic=False, fullgraph=True)(x)
    torch.testing.assert_close(got, f(x), atol=0, rtol=0)
    assert native.native_status()["native"]
