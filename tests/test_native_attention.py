"""The native ragged decode attention: each row's one query over its own cache slots [0, last[row]]."""

import pytest
import torch

from draftsmith.engine import native
from draftsmith.engine.native import masked_decode_attention, native_available, ragged_decode_attention, uses_native


def _reference(q, k, v, last, scale):
    """float64, one row and head at a time, straight from the definition."""
    b, nh, d = q.shape
    g = nh // k.shape[1]
    out = torch.empty(b, nh, d, dtype=torch.float64)
    for i in range(b):
        for h in range(nh):
            kk = k[i, h // g, :int(last[i]) + 1].double()
            vv = v[i, h // g, :int(last[i]) + 1].double()
            p = torch.softmax((kk @ q[i, h].double()) * scale, dim=0)
            out[i, h] = p @ vv
    return out


def _case(b, nh, nk, d, cap, dtype, seed=0, rows=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, d, generator=g).to(dtype)
    k = torch.randn(rows or b, nk, cap, d, generator=g).to(dtype)
    v = torch.randn(rows or b, nk, cap, d, generator=g).to(dtype)
    last = torch.randint(0, cap, (b,), generator=g)
    last[0], last[-1] = 0, cap - 1  # a row that sees only its own slot, a row that fills the cache
    return q, k, v, last


def test_the_native_kernel_builds_on_this_cpu():
    """CI runs on the machines users get: the kernel must build there (a C++ compiler is what inductor needs too),
    or every decode step falls back to the slower masked call."""
    assert native_available(), native.native_status()
    assert native.native_status()["capability"] in ("AVX512", "AVX2", "DEFAULT")


# (8, 1, 64): the most query heads a key/value head the register-held value pass covers; (20, 2, 64): past it,
# the general loop
@pytest.mark.parametrize("nh,nk,d", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 32), (8, 1, 64), (20, 2, 64)])
def test_float32_equals_the_definition(nh, nk, d):
    q, k, v, last = _case(7, nh, nk, d, 50, torch.float32, seed=nh + d, rows=9)  # more cache rows than queries
    assert uses_native(q)
    got = ragged_decode_attention(q, k, v, last, d ** -0.5)
    torch.testing.assert_close(got.double(), _reference(q, k, v, last, d ** -0.5), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, masked_decode_attention(q, k, v, last, d ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("nh,nk,d", [(9, 3, 64), (20, 2, 64), (4, 2, 128)])
def test_bfloat16_is_within_bf16_rounding_of_the_definition(nh, nk, d):
    q, k, v, last = _case(12, nh, nk, d, 300, torch.bfloat16, seed=5)
    got = ragged_decode_attention(q, k, v, last, d ** -0.5)
    ref = _reference(q, k, v, last, d ** -0.5)
    err = (got.double() - ref).abs().max().item()
    assert err < 0.02, err  # a bf16 output rounds at ~0.4% of its magnitude (|out| < 4 here)
    sdpa = masked_decode_attention(q, k, v, last, d ** -0.5)
    assert (sdpa.double() - ref).abs().max().item() < 0.02


def test_a_sliced_cache_view_is_read_through_its_strides():
    """The eager data engine hands attention `keys[:n, :, :span]` of a larger buffer."""
    q, k, v, last = _case(5, 4, 2, 16, 64, torch.float32, seed=2)
    last = last.clamp(max=39)
    kv, vv = k[:, :, :40], v[:, :, :40]
    assert not kv.is_contiguous()
    got = ragged_decode_attention(q, kv, vv, last, 0.25)
    torch.testing.assert_close(got.double(), _reference(q, k, v, last, 0.25), atol=2e-6, rtol=1e-5)


def test_slots_past_a_rows_last_do_not_matter():
    q, k, v, last = _case(6, 4, 2, 16, 32, torch.float32, seed=8)
    a = ragged_decode_attention(q, k, v, last, 0.25)
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(last.tolist()):
        k2[i, :, n + 1:] = 1e4  # would dominate every softmax if it were read
        v2[i, :, n + 1:] = float("nan")
    torch.testing.assert_close(ragged_decode_attention(q, k2, v2, last, 0.25), a, atol=0, rtol=0)


def test_a_slot_outside_the_cache_is_a_clear_error():
    q, k, v, last = _case(3, 4, 2, 16, 10, torch.float32)
    last[1] = 10
    with pytest.raises(RuntimeError, match="row 1 attends to slot 10 outside the cache's 10 slots"):
        torch.ops.draftsmith_native.ragged_decode_attention(q, k, v, last, 0.25)


def test_unsupported_head_size_and_dtype_use_the_masked_call():
    q, k, v, last = _case(4, 4, 2, 12, 20, torch.float32)  # 12 is no multiple of any vector width
    assert not uses_native(q)
    torch.testing.assert_close(ragged_decode_attention(q, k, v, last, 0.3).double(), _reference(q, k, v, last, 0.3),
                               atol=2e-6, rtol=1e-5)
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert not uses_native(q64)
    torch.testing.assert_close(ragged_decode_attention(q64, k64, v64, last, 0.3), _reference(q, k, v, last, 0.3))


def test_compiled_callers_see_one_opaque_node_for_any_lengths():
    """A compiled decode step must not specialise on the rows' lengths (they change every step)."""
    from torch._dynamo.testing import CompileCounter
    cnt = CompileCounter()

    @torch.compile(backend=cnt, dynamic=False)
    def f(q, k, v, last):
        return ragged_decode_attention(q * 2, k, v, last, 0.25) + 1

    q, k, v, last = _case(5, 4, 2, 16, 40, torch.float32)
    for shift in range(3):
        lt = (last + shift * 7).clamp(max=39)
        torch.testing.assert_close(f(q, k, v, lt), ragged_decode_attention(q * 2, k, v, lt, 0.25) + 1)
    assert cnt.frame_count == 1


def test_attention_bench_times_the_kernel_beside_masked_sdpa(tmp_path):
    from benchmarks.attention_bench import main

    res = main(["--layers", "2", "--rows", "4", "--capacity", "64", "--min-slots", "1", "--max-slots", "60",
                "--out", str(tmp_path / "a.json")])
    assert set(res["ops"]) == {"native", "masked SDPA"}
    assert all(f["cold_ms"] > 0 and f["warm_ms"] > 0 for f in res["ops"].values())
    assert (tmp_path / "a.json").exists() and res["native"]["native"]


def test_bfloat16_with_sharp_attention_over_partial_blocks():
    """Scores peaked enough that a slot's score landing on another slot (a wrong lane in the 16-slot reduction of
    the AVX512_BF16 path) changes the output by about 1; every length from 1 to 48 (whole and partial blocks)."""
    g = torch.Generator().manual_seed(3)
    b = 48
    q = (torch.randn(b, 9, 64, generator=g) * 4).to(torch.bfloat16)
    k = torch.randn(b, 3, 64, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(b, 3, 64, 64, generator=g).to(torch.bfloat16)
    last = torch.arange(b)
    got = ragged_decode_attention(q, k, v, last, 0.125)
    ref = _reference(q, k, v, last, 0.125)
    assert (got.double() - ref).abs().max().item() < 0.05


def test_a_failed_avx512_bf16_build_falls_back_to_the_plain_build(monkeypatch):
    """A compiler that cannot build the AVX512_BF16 variant must cost the dot product only, not the kernel."""
    built = []

    def fake_build(cap, bf16_dot):
        built.append(bf16_dot)
        if bf16_dot:
            raise RuntimeError("error: unrecognized command-line option '-mavx512bf16'")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", fake_build)
    monkeypatch.setattr(native, "_bf16_dot", lambda: True)
    monkeypatch.setattr(torch.library, "register_fake", lambda name: (lambda fn: fn))
    assert native.native_available()
    assert built == [True, False]
    assert native.native_status()["bf16_dot"] is False and native.native_status()["native"]


def test_build_flags_name_each_variant():
    plain = native.build_flags("AVX512", False)
    dot = native.build_flags("AVX512", True)
    assert plain[0] != dot[0] and "-mavx512bf16" in dot[1] and "-mavx512bf16" not in plain[1]
    avx2 = native.build_flags("AVX2", False)[1]
    assert "-mavx2" in avx2 and "-mavx512f" not in avx2
