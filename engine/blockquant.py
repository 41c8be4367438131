"""Float32 weights that are exactly 4-bit or 8-bit blocks, found and packed for the decoding kernels.

A target loaded from a GGUF file holds the file's quantised tensors dequantised to float32. The default target's
file stores its layers' weights as Q4_1 (blocks of 32: an fp16 scale d, an fp16 offset m, 4-bit q, w = d*q + m)
and its embedding, which is also its output head, as Q8_0 (w = d*q, q 8-bit signed). Dequantised, every block
is still 32 numbers on a grid of 16 or 256 steps: the float32 model reads 32 bits a weight to carry 4.5 or 8.5
bits of information, and a decoding step, which is bound by reading the weights, pays for it.

`pack` finds that grid from the float32 numbers alone (no GGUF file needed, any tensor): per block of 32, a
float32 scale d, offset m and small integers q with ``fma(d, q, m)`` equal to every weight bit for bit (d*q is
exact in float32, so a fused multiply-add rounds once, as the dequantisation did). A tensor is packed only if
every block reproduces; otherwise `pack` returns None and the weight stays float32. The native kernel
``rows_linear_q`` (csrc/rows_linear_q.cpp) widens the packed weights in registers and sums in the same chain as
the float32 kernel, so its outputs are the float32 kernel's, bit for bit: same model, same arithmetic, a sixth
of the bytes read.

How the grid is found (ggml's quantisers): for 4 bits, the smallest weight of a block has q = 0, so m is the
block's minimum, and the largest has q = 15, so d is near (max - min) / 15, an fp16 number; the fp16 neighbours
of that quotient are tried and the first that reproduces the block is kept. For 8 bits, m = 0 and d is near
max |w| / 127 (Q8_0), max |w| / 16 (Q5_0: q - 16 in -16..15) or max |w| / 8 (Q4_0: q - 8 in -8..7), each tried
per block: files quantised "Q4_K_M" hold most of their matrices as Q5_0 and Q8_0, which all pack at 8 bits. Their
K-quant tensors have sub-block scales that are not fp16 numbers (an fp16 number times a 6- or 8-bit integer), which
this search does not find: `from_q4_k` and `from_q6_k` read Q4_K and Q6_K tensors from the GGUF file instead
(`draftsmith.engine.fastpath` does, for the target's shipped file): Q4_K as 4-bit blocks of 32, Q6_K as int8
weights with a scale per 16 (the kernel's "6-bit" mode). A constant block (d = 0) reproduces with q = 0.

A zero weight may be stored as -0.0 (ggml's symmetric formats multiply q - 16 = 0 by a negative scale); packed,
it is +0.0. The two give the same sums: a product with either zero adds nothing to a non-zero accumulator, and an
accumulator that starts at +0.0 never becomes -0.0 (x + (-x) is +0.0 when rounding to nearest), so the kernel's
outputs stay the float32 kernel's, bit for bit, and the search compares the weights with their zeros made +0.0.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK = 32
# part of the packed cache's key: a new layout, or a new search (which changes what packs), a new entry
LAYOUT = "blocks of 32; 4-bit in the GGUF Q4 order; 8-bit from Q8_0, Q5_0 and Q4_0 scales; -0.0 as +0.0"
#: |q| of a symmetric block's largest weight in the formats the 8-bit search tries: Q8_0, Q5_0, Q4_0
SYMMETRIC_LEVELS = (127, 16, 8)
_CACHE_FROM = 1 << 22  # weights in all, from which `pack_groups` keeps its result on disk (a tiny model: never)
_CHUNK = 1 << 20  # blocks derived at a time (float32 temporaries of 128 MB at most)


class Packed(torch.nn.Module):
    """A weight [n, k] as blocks of 32: ``q`` uint8 [n, k/2] (4 bits: byte j of a block holds weight j in its
    low nibble, weight j + 16 in its high one, the GGUF Q4 order) or int8 [n, k] (8 bits); ``d``, ``m`` float32
    [n, k/32]. ``bits`` 6 (a Q6_K tensor, `from_q6_k`): int8 [n, k] with ``d``, ``m`` [n, k/16], a scale per 16
    weights. A module whose buffers a compiled forward freezes with the other weights."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.bits = int(bits)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m))


def _fp16_neighbours(x: torch.Tensor) -> list[torch.Tensor]:
    """float32 ``x`` as the nearest fp16 number and its two fp16 neighbours: the scales to try. Only fp16 scales:
    with 11 significant bits, d*q is exact in float32, so the check below (a product, then a sum) and the
    kernel's fused multiply-add round the same way."""
    h = x.to(torch.float16)
    u = h.view(torch.int16)
    return [h.float(), (u + 1).view(torch.float16).float(), (u - 1).view(torch.float16).float()]


def _derive(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q, d, m) for float32 blocks [N, 32] that reproduce every block exactly, else None.

    All in float32: with d an fp16 number (11 significant bits) and |q| <= 128, d*q is exact in float32, and
    adding m rounds once, as the kernel's fused multiply-add does."""
    if bits == 4:
        m = blocks.min(1).values
        lo, hi, scales = 0, 15, [(blocks.max(1).values - m) / 15]
    else:  # symmetric grids d * q, the largest |w| at |q| = 127 (Q8_0), 16 (Q5_0) or 8 (Q4_0)
        m = torch.zeros(blocks.shape[0], dtype=torch.float32)
        amax = blocks.abs().max(1).values
        lo, hi, scales = -128, 127, [amax / levels for levels in SYMMETRIC_LEVELS]
    want = (blocks + 0.0).view(torch.int32)  # -0.0 as +0.0 (see the module docstring)
    found = torch.zeros(blocks.shape[0], dtype=torch.bool)
    d = torch.zeros(blocks.shape[0], dtype=torch.float32)
    q = torch.zeros(blocks.shape, dtype=torch.float32)
    for c in [c for scale in scales for c in _fp16_neighbours(scale)]:
        todo = (~found).nonzero().squeeze(1)
        if todo.numel() == 0:
            break
        c = c[todo]
        c = torch.where(torch.isfinite(c) & (c > 0), c, torch.zeros_like(c))
        b, mt = blocks[todo], m[todo][:, None]
        safe = torch.where(c > 0, c, torch.ones_like(c))[:, None]
        qi = torch.where(c[:, None] > 0, ((b - mt) / safe).round(), torch.zeros_like(b)).clamp(lo, hi) + 0.0
        rec = c[:, None] * qi + mt
        ok = (rec.view(torch.int32) == want[todo]).all(1)
        idx = todo[ok]
        found[idx] = True
        d[idx] = c[ok]
        q[idx] = qi[ok]
    if not found.all():
        return None
    return q.long(), d, m


def pack(w: torch.Tensor, bits: int) -> Packed | None:
    """``w`` [n, k] float32 (k a multiple of 32) as exact blocks of ``bits`` (4 or 8), or None where any block
    is not exactly such a block (a weight that did not come from a 4-bit or 8-bit file, say)."""
    if bits not in (4, 8):
        raise ValueError(f"pack: 4 or 8 bits, not {bits}")
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % BLOCK or w.device.type != "cpu":
        return None
    n, k = w.shape
    blocks = w.detach().contiguous().view(-1, BLOCK)
    qs, ds, ms = [], [], []
    for s in range(0, blocks.shape[0], _CHUNK):
        got = _derive(blocks[s:s + _CHUNK], bits)
        if got is None:
            return None
        qs.append(got[0])
        ds.append(got[1])
        ms.append(got[2])
    q = torch.cat(qs).view(n, k // BLOCK, BLOCK)
    if bits == 4:
        q = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).reshape(n, k // 2)
    else:
        q = q.to(torch.int8).reshape(n, k)
    return Packed(q.contiguous(), torch.cat(ds).view(n, k // BLOCK), torch.cat(ms).view(n, k // BLOCK), bits)


def unpack(p: Packed) -> torch.Tensor:
    """The float32 weight a `Packed` holds (the reference for tests: the kernel computes with exactly these)."""
    n = p.q.shape[0]
    if p.bits == 4:
        b = p.q.view(n, -1, 16).long()
        q = torch.cat([b & 0x0F, b >> 4], dim=-1)
    elif p.bits == 6:  # a scale per 16 weights
        q = p.q.view(n, -1, 16).long()
    else:
        q = p.q.view(n, -1, BLOCK).long()
    return (p.d.double()[..., None] * q + p.m.double()[..., None]).float().reshape(n, -1)


def quantize(w: torch.Tensor, bits: int, fmt: str | None = None) -> torch.Tensor:
    """``w`` rounded as ggml's Q4_1 (bits 4) or Q8_0 (bits 8) quantiser rounds it, dequantised to float32: a
    float32 weight that `pack` finds exact (tests build such targets; no real model needs it). ``fmt`` "q5_0" or
    "q4_0": ggml's symmetric 5-bit or 4-bit blocks instead (d = the signed largest weight / -16 or -8, stored as
    fp16), which `pack` finds at 8 bits."""
    b = w.detach().float().reshape(-1, BLOCK).double()
    if fmt is not None:
        half = {"q5_0": 16, "q4_0": 8}[fmt]
        big = b.gather(1, b.abs().argmax(1, keepdim=True))[:, 0]  # the signed weight of largest magnitude
        d32 = big / -half
        q = torch.where(d32[:, None] != 0, (b / torch.where(d32 != 0, d32, 1.0)[:, None] + half + 0.5).floor(),
                        torch.full_like(b, half)).clamp(0, 2 * half - 1)
        out = d32.to(torch.float16).double()[:, None] * (q - half)
        return (out + 0.0).float().reshape(w.shape)
    if bits == 4:
        mn, mx = b.min(1).values, b.max(1).values
        d32 = (mx - mn) / 15  # q from the unrounded scale and minimum, then both stored as fp16 (ggml's order)
        q = torch.where(d32[:, None] > 0, ((b - mn[:, None]) / d32.clamp_min(1e-30)[:, None]).round(),
                        torch.zeros_like(b)).clamp(0, 15)
        out = d32.to(torch.float16).double()[:, None] * q + mn.to(torch.float16).double()[:, None]
    else:
        d = (b.abs().max(1).values / 127).to(torch.float16).double()
        q = torch.where(d[:, None] > 0, (b / d.clamp_min(1e-30)[:, None]).round(), torch.zeros_like(b)).clamp(-127, 127)
        out = d[:, None] * (q + 0.0)  # q an integer: no -0.0 (round(-0.3) is -0.0; ggml's int8 0 gives +0.0)
    return out.float().reshape(w.shape)


def _digest(groups: dict[str, list[torch.Tensor]]) -> str:
    import hashlib
    h = hashlib.sha1(LAYOUT.encode())
    for name, ws in groups.items():
        h.update(name.encode())
        for w in ws:
            h.update(str(tuple(w.shape)).encode())
            h.update(memoryview(w.detach().contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()[:24]


def pack_groups(groups: dict[str, list[torch.Tensor]], cache_dir=None) -> dict[str, list[Packed]]:
    """Each group of float32 weights (a model's qkv matrices, say) packed at 4 bits, else at 8, else left out:
    a group is packed only if every weight in it is exact at that width. ``cache_dir``: finding the grids takes
    seconds for a 135M model; the result (packed or not) is kept there under a digest of the weights' bytes
    (reading them costs a fraction of a second) and read back by later processes; models of fewer than
    `_CACHE_FROM` weights are not cached."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    path = None
    if cache_dir is not None and sum(w.numel() for ws in groups.values() for w in ws) >= _CACHE_FROM:
        path = Path(cache_dir) / f"{_digest(groups)}.safetensors"
        if path.exists():
            try:
                st = load_file(str(path))
                meta = json.loads(path.with_suffix(".json").read_text())
                return {name: [Packed(st[f"{name}.{i}.q"], st[f"{name}.{i}.d"], st[f"{name}.{i}.m"], bits)
                               for i in range(len(groups[name]))] for name, bits in meta["bits"].items()}
            except Exception as e:  # a torn or foreign file: derive again and overwrite it
                log.warning("ignoring the packed-weight cache %s (%s)", path, e)
    out: dict[str, list[Packed]] = {}
    for name, ws in groups.items():
        for bits in (4, 8):
            packs = []
            for w in ws:
                p = pack(w, bits)
                if p is None:
                    break
                packs.append(p)
            if len(packs) == len(ws):
                out[name] = packs
                break
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"{name}.{i}.{k}": getattr(p, k).contiguous() for name, ps in out.items()
                   for i, p in enumerate(ps) for k in ("q", "d", "m")}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        path.with_suffix(".json").write_text(json.dumps({"bits": {n: ps[0].bits for n, ps in out.items()}}))
        tmp.rename(path)
    return out


# ------------------------------------------------------------------ K-quant blocks, read from the GGUF file
Q4_K_BYTES = 144  # ggml's block_q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' 6-bit scales and mins of Q4_K super-blocks, from their 12 packed bytes [N, 12] (ggml's
    ``get_scale_min_k4``)."""
    sc = sc.astype(np.uint8)
    s, m = np.empty((sc.shape[0], 8), np.uint8), np.empty((sc.shape[0], 8), np.uint8)
    s[:, :4], m[:, :4] = sc[:, :4] & 63, sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:12] & 0x0F) | ((sc[:, 0:4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return s, m


def from_q4_k(raw, n: int, k: int) -> Packed:
    """A GGUF Q4_K tensor's bytes ([n, k / 256 * 144] uint8, a row of n) as 4-bit blocks of 32: sub-block j of a
    super-block has scale D = d * sc_j and offset M = -(dmin * m_j), both exact in float32 (an fp16 number times
    a 6-bit integer), and ggml dequantises each weight as D * q - dmin * m_j, rounded once: ``fma(D, q, M)``, which
    is what the packed kernel computes. The caller checks the result against the float32 weight it replaces."""
    if k % 256 or raw.shape != (n, k // 256 * Q4_K_BYTES):
        raise ValueError(f"from_q4_k: {tuple(raw.shape)} bytes for a [{n}, {k}] Q4_K tensor")
    b = np.ascontiguousarray(raw).reshape(-1, Q4_K_BYTES)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [S, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _scale_min_k4(b[:, 4:16])
    D = d * sc.astype(np.float32)  # [S, 8], exact
    M = -(dmin * mn.astype(np.float32))
    qs = b[:, 16:].reshape(-1, 4, 32)  # four runs of 32 bytes: low nibbles = sub-block 2t, high = 2t + 1
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # [S, 8 sub-blocks, 32 weights]
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # our order: byte j = weight j, weight j + 16
    return Packed(torch.from_numpy(packed.reshape(n, k // 2).copy()),
                  torch.from_numpy(np.ascontiguousarray(D.reshape(n, k // 32))),
                  torch.from_numpy(np.ascontiguousarray(M.reshape(n, k // 32))), 4)


def exact_for(p: Packed, w: torch.Tensor) -> bool:
    """Whether ``p`` holds ``w`` exactly (zeros of either sign alike: the module docstring)."""
    return p.q.shape[0] == w.shape[0] and torch.equal((unpack(p) + 0.0).view(torch.int32),
                                                      (w.detach().float() + 0.0).view(torch.int32))


Q6_K_BYTES = 210  # ggml's block_q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d


def from_q6_k(raw, n: int, k: int) -> Packed:
    """A GGUF Q6_K tensor's bytes ([n, k / 256 * 210] uint8) as "6-bit" blocks: q = the 6-bit value - 32 (int8),
    one scale per 16 weights D = d * sc (an fp16 number times an 8-bit integer: exact in float32) and no offset.
    ggml dequantises each weight as D * q, rounded once: ``fma(D, q, 0)``, what the packed kernel computes (a zero
    product's sign aside: the module docstring). Weight j of a super-block half h (128 weights) and its group g
    = j // 32: the low nibble of byte j % 32 (+ 32 for odd g) of the half's 64 (the high nibble for g >= 2), and
    bits 2g, 2g + 1 of byte j % 32 of its 32 high bytes. The caller checks the result against the float32 weight."""
    if k % 256 or raw.shape != (n, k // 256 * Q6_K_BYTES):
        raise ValueError(f"from_q6_k: {tuple(raw.shape)} bytes for a [{n}, {k}] Q6_K tensor")
    b = np.ascontiguousarray(raw).reshape(-1, Q6_K_BYTES)
    s = b.shape[0]
    ql = b[:, :128].reshape(s, 2, 64)
    qh = b[:, 128:192].reshape(s, 2, 32)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [S, 16]
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # [S, 1]
    lo = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=2)
    hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=2)
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    D = (d * sc).reshape(n, k // 16)
    return Packed(torch.from_numpy(q.copy()), torch.from_numpy(np.ascontiguousarray(D)),
                  torch.zeros(n, k // 16, dtype=torch.float32), 6)


#: the GGUF K-quant types read from the file, by ggml's name
K_QUANT_READERS = {"Q4_K": from_q4_k, "Q6_K": from_q6_k}
