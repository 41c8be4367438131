"""Native CPU kernels, built on first use, and the custom ops that call them.

``ragged_decode_attention(q, k, v, last, scale)``: one query token per row, row i attending to its own cache
slots [0, last[i]] (``q`` [rows, heads, head_dim]; ``k``, ``v`` [cache rows >= rows, kv_heads, capacity,
head_dim], slots contiguous). It is what a continuous-batching decode step needs: rows of different lengths in
one pre-allocated cache. Three ways to compute it, the first that applies:

  * on CPU in float32 or bfloat16, the C++ kernel of ``csrc/ragged_attention.cpp``: it reads each row's own
    entries once for every query head that shares them, float32 accumulation. It is built with
    `torch.utils.cpp_extension` for the CPU's vector capability (``torch.backends.cpu.get_cpu_capability()``:
    AVX512, AVX2 or scalar) into the torch extensions folder, a few seconds once per machine kind. On an AVX-512
    CPU with AVX512_BF16 (``torch.cpu._is_avx512_bf16_supported()``) a second build computes bf16 scores with
    that extension's dot product (``DRAFTSMITH_AVX512_BF16=0`` turns it off);
  * elsewhere (a GPU, another dtype, no compiler, ``DRAFTSMITH_NATIVE=0``): one masked SDPA call over the longest
    row's span.

Measured on a 2-core Xeon with AMX (bf16, 9 query / 3 key-value heads of 64, one layer's cache warm): 96 rows
of 40-300 slots, the kernel 0.64 ms, masked SDPA 1.74 ms; 96 rows of 100-700 slots, masked SDPA 3.8 ms, one SDPA
call per row 4.7 ms. With 30 layers' caches read in turn, as a decode step reads them (the same 96 rows,
`python -m benchmarks.attention_bench --compare-source`): bf16 1.19-1.23 ms a layer before the dot product and
its prefetching, 1.04-1.08 ms after (float32 unchanged, 1.73 ms; docs/results-log.md §21).

The op is a ``torch.library`` custom op, opaque to ``torch.compile``: a compiled decode step calls it as one
node and never specialises on the rows' lengths.

``rows_linear(x, w, bias)`` (``csrc/rows_linear.cpp``): ``F.linear`` for a decoding step's few rows, each weight
read once at close to the memory's bandwidth, the same bits for a row whatever rows are beside it; `decode_linear`
routes to it (``DRAFTSMITH_ROWS_LINEAR=0`` turns it off): float32 up to `ROWS_LINEAR_MAX` rows everywhere;
bfloat16 on a CPU without AVX512_BF16, where torch has no bf16 instruction to multiply with (an AVX2 CPU: the
kernel widens each weight to float32 in registers as it reads it), for any number of rows, prefills included;
on one with AVX512_BF16 and no AMX (AMD Zen 4 and 5), up to `ROWS_LINEAR_MAX` rows, multiplied by VDPBF16PS
(2-core Zen 4 EPYC: the 49152 x 576 LM head 1.39 ms for one row against oneDNN's 5.67, 7.1 against 8.1 for 16;
docs/results-log.md §46). On a CPU with AMX, bf16 products stay with oneDNN (the kernel is not measured there).

``ragged_prefill_attention``: the prefill counterpart, prompts as one flat run of tokens (no padding), each
attending causally within its own cache row after a shared prefix; one SDPA call per prompt.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SRCS = [Path(__file__).parent / "csrc" / f
         for f in ("ragged_attention.cpp", "rows_linear.cpp", "rows_linear_q.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / "widen.h"]
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "why": the reason it is not used; "capability"

# vector capability -> (preprocessor defines as at::vec reads them, compiler flags)
_FLAGS = {
    "AVX512": (["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
               ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]),
    "AVX2": (["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"], ["-mavx2", "-mfma"]),
}


@functools.cache
def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return "AVX512"
    return "AVX2" if cap == "AVX2" else "DEFAULT"


@functools.cache
def _bf16_dot() -> bool:
    """Whether the kernel is built with AVX512_BF16's dot product for bf16 scores (the CPU has it; an AVX-512
    build only; ``DRAFTSMITH_AVX512_BF16=0`` turns it off)."""
    if _capability() != "AVX512" or os.environ.get("DRAFTSMITH_AVX512_BF16", "1") == "0":
        return False
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def build_flags(cap: str, bf16_dot: bool) -> tuple[str, list[str]]:
    """The library name and compiler flags of the kernels' build for vector capability ``cap``."""
    defines, flags = _FLAGS.get(cap, ([], []))
    name = f"draftsmith_native_{cap.lower()}"
    if bf16_dot:
        defines, flags, name = [*defines, "-DDRAFTSMITH_AVX512_BF16"], [*flags, "-mavx512bf16"], name + "_bf16"
    return name, ["-O3", "-fopenmp", *defines, *flags]


def _build(cap: str, bf16_dot: bool) -> None:
    """Build (or load from the extensions folder) and load the kernels for vector capability ``cap``.

    torch's loader takes a lock file in the build folder for every load, up to date or not, and a process
    that finds it waits until it is gone, with no timeout. A process killed while loading (kill -9, an OOM kill)
    leaves the file behind, and every later process then hangs. So loads go through an ``flock`` of our own,
    which the system releases when its holder dies: whoever holds it is the only one of ours loading, and a
    torch lock file it finds is stale (removed, with a warning)."""
    import fcntl

    from torch.utils import cpp_extension
    name, cflags = build_flags(cap, bf16_dot)
    # torch rebuilds when a source or a flag changes, not a header: the headers' hash goes in as a flag
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:12]
    where = getattr(cpp_extension, "_get_build_directory", None)
    build_dir = Path(where(name, False)) if where is not None else None
    with open(os.devnull if build_dir is None else build_dir.parent / f"{name}.load.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        stale = None if build_dir is None else build_dir / "lock"
        if stale is not None and stale.exists():
            log.warning("removing %s, left by a process killed while it loaded the native kernels", stale)
            stale.unlink(missing_ok=True)
        # torch runs `ninja` from PATH: the environment's own (setup.sh installs it) first, also when the
        # environment is not activated (`.venv/bin/draftsmith`), so every build uses one ninja: another
        # version (a system one) reads the build log as too new or too old and rebuilds everything (43 s on a
        # Zen 1 EPYC), and a machine without one would run without the kernels
        path = os.environ.get("PATH", "")
        own = str(Path(sys.executable).parent)
        if (Path(own) / "ninja").exists() and path.split(os.pathsep)[0] != own:
            os.environ["PATH"] = own + os.pathsep + path
        try:
            cpp_extension.load(name=name, sources=[str(p) for p in _SRCS],
                               extra_cflags=[*cflags, f"-DDRAFTSMITH_HEADERS={digest}"], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
        finally:
            os.environ["PATH"] = path


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"


def native_available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the native kernels. False,
    with the reason in `native_status`, when they cannot be used: ``DRAFTSMITH_NATIVE=0``, no C++ compiler, or
    a build error (logged once)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        cap = _capability()
        _state["capability"] = cap
        if os.environ.get("DRAFTSMITH_NATIVE", "1") == "0":
            _state.update(ok=False, why="DRAFTSMITH_NATIVE=0")
            return False
        try:
            bf16_dot = _bf16_dot()
            if bf16_dot:
                try:
                    _build(cap, bf16_dot=True)
                except Exception as e:  # a compiler without -mavx512bf16, say: the build without it
                    log.warning("the AVX512_BF16 build of the native kernels failed (%s); building without it",
                                _reason(e))
                    bf16_dot = False
            if not bf16_dot:
                _build(cap, bf16_dot=False)
            torch.library.register_fake("draftsmith_native::ragged_decode_attention")(
                lambda q, k, v, last, scale: torch.empty_like(q))  # a compiled graph may call the kernel itself
            torch.library.register_fake("draftsmith_native::block_attention")(
                lambda q, k, v, last, allow, scale: torch.empty_like(q))
            torch.library.register_fake("draftsmith_native::rows_linear")(
                lambda x, w, bias=None: x.new_empty((*x.shape[:-1], w.shape[0])))
            torch.library.register_fake("draftsmith_native::rows_linear_q")(
                lambda x, q, d, m, bits, bias=None: x.new_empty((*x.shape[:-1], q.shape[0])))
            _state.update(ok=True, why=None, bf16_dot=bf16_dot)
        except Exception as e:  # no compiler, a failed build: the SDPA fallback computes the same
            _state.update(ok=False, why=_reason(e))
            log.warning("native CPU kernels unavailable (%s); decode attention falls back to masked SDPA",
                        _state["why"])
        env = os.environ.get("DRAFTSMITH_PREFETCH_BYTES")
        if _state["ok"] and env is not None:  # a bad value is an error, not kernels turned off
            torch.ops.draftsmith_native.set_prefetch_bytes(_prefetch_env(env))
        return _state["ok"]


PREFETCH_BYTES = 4096  # rows_linear's default: csrc/widen.h


def _prefetch_env(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 1 << 20:
        raise ValueError(f"DRAFTSMITH_PREFETCH_BYTES must be a byte count from 0 to 1048576, got {value!r}")
    return n


def set_prefetch_bytes(n: int) -> int:
    """How far ahead of the weight row being multiplied the ``rows_linear`` kernel asks the memory for the next
    rows (into L2), in bytes (0: not at all; default `PREFETCH_BYTES`, ``DRAFTSMITH_PREFETCH_BYTES`` at load);
    returns the previous setting. A hint to the caches: results are the same bits either way. Every call reads it,
    so a benchmark can measure with and without it in one process (`benchmarks.step_cost`'s ``:noprefetch``).
    ``rows_linear_q`` (packed 4/8-bit weights) does not prefetch: widening the blocks bounds it, not reading them
    (docs/results-log.md §51)."""
    if not native_available():
        raise RuntimeError(f"the native kernels are not loaded: {native_status()['why']}")
    return int(torch.ops.draftsmith_native.set_prefetch_bytes(int(n)))


def native_status() -> dict:
    """What the last `native_available` found: ``{"native": bool, "capability": ..., "why": ...}``."""
    return {"native": bool(_state.get("ok")), "capability": _state.get("capability"), "why": _state.get("why"),
            "bf16_dot": bool(_state.get("bf16_dot"))}


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The reference computation: one SDPA call over slots [0, max(last)], each row's later slots masked."""
    b = q.shape[0]
    span = int(last.max()) + 1
    allowed = torch.arange(span, device=q.device)[None] <= last.to(q.device)[:, None]
    mask = torch.zeros((b, 1, 1, span), dtype=q.dtype, device=q.device)
    mask.masked_fill_(~allowed[:, None, None], torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q[:, :, None], k[:b, :, :span], v[:b, :, :span], attn_mask=mask,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[:, :, 0]


def native_for(dtype: torch.dtype, device: torch.device | str, head_dim: int):
    """The native kernel for queries of this dtype, device and head size (None where it does not apply): a CPU
    tensor in float32 or bfloat16 whose head size is a multiple of the vector width, up to 16 vectors. A
    compiled step whose inputs always qualify calls it directly, without the custom op's Python checks (~0.15 ms
    a call, 30 calls a step); its cache must have contiguous slots."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    width = 16 if _capability() == "AVX512" else 8
    if head_dim % width or head_dim // width > 16 or not native_available():
        return None
    return torch.ops.draftsmith_native.ragged_decode_attention


def block_for(dtype: torch.dtype, device: torch.device | str, head_dim: int):
    """The native kernel for a speculative block of queries in one cache row, each attending to the slots before
    the block and to the block's slots its mask allows (``draftsmith_native::block_attention``: the decode kernel
    with the block's mask), where `native_for` applies; None elsewhere."""
    return None if native_for(dtype, device, head_dim) is None else torch.ops.draftsmith_native.block_attention


def uses_native(q: torch.Tensor) -> bool:
    """Whether `ragged_decode_attention` runs the native kernel for a query like ``q`` (`native_for`)."""
    return native_for(q.dtype, q.device, q.shape[-1]) is not None


def contiguous_slots(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a cache's slots are contiguous, as the native attention kernels read them: each key a run of
    head_dim numbers, the values laid out as the keys."""
    return k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and v.stride() == k.stride()


@torch.library.custom_op("draftsmith::ragged_decode_attention", mutates_args=())
def ragged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Row i's one query attends to its own slots [0, last[i]]; see the module docstring."""
    op = native_for(q.dtype, q.device, q.shape[-1])
    if op is not None and contiguous_slots(k, v):
        return op(q, k, v, last, scale)
    return masked_decode_attention(q, k, v, last, scale)


@ragged_decode_attention.register_fake
def _(q, k, v, last, scale):
    return torch.empty_like(q)


@torch.library.custom_op("draftsmith::ragged_prefill_attention", mutates_args=())
def ragged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                             starts: torch.Tensor, offsets: torch.Tensor, scale: float) -> torch.Tensor:
    """Prompts prefilled together as one flat run of tokens: prompt g's tokens are ``q[starts[g]:starts[g + 1]]``
    ([T, heads, head_dim] in all), at positions ``offsets[g]``, ``offsets[g] + 1``, ... of cache row ``rows[g]``,
    whose keys and values (the prompt's own, and a shared prefix before ``offsets[g]``) are already written;
    token j of prompt g attends causally to slots [0, offsets[g] + j]. One SDPA call per prompt (its flash
    kernel suits many queries; the decode kernel reads keys once per query)."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    for r, s, e, off in zip(rows.tolist(), starts[:-1].tolist(), starts[1:].tolist(), offsets.tolist()):
        w = e - s
        qi = q[s:e].transpose(0, 1)[None]
        ki, vi = k[r:r + 1, :, :off + w], v[r:r + 1, :, :off + w]
        if off == 0:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            pos = torch.arange(off, off + w, device=q.device)
            allowed = torch.arange(off + w, device=q.device)[None] <= pos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1)
    return out


@ragged_prefill_attention.register_fake
def _(q, k, v, rows, starts, offsets, scale):
    return torch.empty_like(q)


@torch.library.custom_op("draftsmith::ragged_block_attention", mutates_args=())
def ragged_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                           starts: torch.Tensor, last: torch.Tensor, allow: torch.Tensor, scale: float) -> torch.Tensor:
    """Speculative blocks of many sequences (a batched verification), as one flat run of queries: block g is
    ``q[starts[g]:starts[g + 1]]`` ([T, heads, head_dim] in all; its width c_g, no padding), in cache row
    ``rows[g]`` at slots ``last[starts[g] + j]``, the first of them the block's start; query j attends to every
    slot before the block's start and to block slot start + i where ``allow[g, j, i]`` ([n, m, m] bool, m at
    least every width; entries past c_g are not read). Each block by the native block kernel where it applies
    (``draftsmith_native::block_attention``, the live slots only), else by one SDPA call over the row's slots
    up to its block's end."""
    out = torch.empty_like(q)
    op = block_for(q.dtype, q.device, q.shape[-1])
    if op is not None and not contiguous_slots(k, v):
        op = None
    gqa = k.shape[1] != q.shape[1]
    bounds = starts.tolist()
    for g, r in enumerate(rows.tolist()):
        a, b = bounds[g], bounds[g + 1]
        c = b - a
        if c == 0:
            continue
        qs, ls, al = q[a:b], last[a:b], allow[g, :c, :c]
        kr, vr = k[r:r + 1], v[r:r + 1]
        if op is not None:
            out[a:b] = op(qs, kr, vr, ls, al, scale)
            continue
        s0 = int(ls[0])
        seen = torch.ones(c, s0 + c, dtype=torch.bool, device=q.device)
        seen[:, s0:] = al
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], kr[:, :, :s0 + c], vr[:, :, :s0 + c],
                                           attn_mask=seen, scale=scale, enable_gqa=gqa)
        out[a:b] = o[0].transpose(0, 1)
    return out


@ragged_block_attention.register_fake
def _(q, k, v, rows, starts, last, allow, scale):
    return torch.empty_like(q)


ROWS_LINEAR_MAX = 16  # up to this many float32 rows a linear runs `rows_linear`; more go to the BLAS product


@functools.cache
def rows_linear_on() -> bool:
    """Whether float32 decoding linears of up to `ROWS_LINEAR_MAX` rows run the native ``rows_linear`` kernel
    (``csrc/rows_linear.cpp``): the native kernels load and ``DRAFTSMITH_ROWS_LINEAR`` is not ``0``. Read once per
    process, before a forward is compiled, so that a compiled graph never calls the check."""
    return os.environ.get("DRAFTSMITH_ROWS_LINEAR", "1") != "0" and native_available()


def _cpu_has_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def _cpu_has_amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


_CPU_BF16 = _cpu_has_bf16()  # read at import: a compiled graph's routing reads these constants, never the check
# bf16 stays with oneDNN on a CPU with AMX (the kernel is not measured there), and where
# DRAFTSMITH_ROWS_LINEAR_BF16=0 (a CPU with AVX512_BF16: oneDNN's product, for a side-by-side measurement)
_CPU_AMX = _cpu_has_amx() or (_CPU_BF16 and os.environ.get("DRAFTSMITH_ROWS_LINEAR_BF16", "1") == "0")


def rows_linear_dtypes() -> frozenset:
    """The dtypes `rows_linear` serves on this CPU (empty when `rows_linear_on` is False): float32 everywhere;
    bfloat16 except on a CPU with AMX, whose bf16 products stay with oneDNN (the kernel is not measured there)."""
    if not rows_linear_on():
        return frozenset()
    return frozenset({torch.float32} if _CPU_AMX else {torch.float32, torch.bfloat16})


def rows_linear_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w.T`` is one the native kernel serves: a dtype of `rows_linear_dtypes` on CPU (whether the kernel
    is on at all is the caller's `rows_linear_on`), a row-major weight (a column-major one,
    `draftsmith.engine.cpu_layout`'s, would be copied on every call), no gradient wanted (the kernel has no
    backward). Float32 up to `ROWS_LINEAR_MAX` rows (BLAS is faster for more). Bfloat16: any number of rows on a
    CPU without bf16 instructions (the kernel is 3-9x faster than torch's product at 16 or 100 rows too); up to
    `ROWS_LINEAR_MAX` rows on one with AVX512_BF16 and no AMX, where the kernel's VDPBF16PS build is 3-4x faster
    than oneDNN's product at 1 row and about even at 16 (a prompt's rows stay with oneDNN); none with AMX."""
    rows = x.numel() // max(1, x.shape[-1])
    if w.dtype == torch.float32:
        fits = rows <= ROWS_LINEAR_MAX
    else:
        fits = w.dtype == torch.bfloat16 and not _CPU_AMX and (rows <= ROWS_LINEAR_MAX or not _CPU_BF16)
    return (fits and x.dtype == w.dtype and x.device.type == "cpu" and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def decode_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, native: bool = True,
                  packed=None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for a decoding step: the native kernel when ``native`` (the caller's `rows_linear_on`,
    read once) and `rows_linear_applies`. It reads each weight once at close to the memory's bandwidth, and gives a
    row the same bits whatever the rows beside it. ``packed``: ``w`` as exact 4-bit or 8-bit blocks
    (`draftsmith.engine.blockquant.Packed`), multiplied by ``rows_linear_q`` with the same bits as the float32
    kernel, reading a sixth or less of the bytes. Everything else is ``F.linear``."""
    if native and packed is not None and rows_linear_applies(x, w) and w.dtype == torch.float32:
        return torch.ops.draftsmith_native.rows_linear_q(x, packed.q, packed.d, packed.m, packed.bits, b)
    if native and rows_linear_applies(x, w):
        return torch.ops.draftsmith_native.rows_linear(x, w, b)
    return F.linear(x, w, b)
