"""Decoding weights on 2 MiB pages (Linux transparent huge pages), read by the native kernels.

A one-row decoding step reads every weight once, straight from memory: a stream of hundreds of megabytes that
the processor translates 4 KiB page by 4 KiB page, a TLB miss and a page walk every few hundred cycles of
streaming. Where transparent huge pages are offered on request (``/sys/kernel/mm/transparent_hugepage/enabled``
is ``madvise``, the usual default, or ``always``), memory advised ``MADV_HUGEPAGE`` is mapped in 2 MiB pages
and the stream walks 512 times fewer pages. torch's allocator advises nothing by default (its own
``THP_MEM_ALLOC_ENABLE`` does it per allocation of 2 MiB or more, which leaves a step's smaller matrices out:
SmolLM2-135M's q/k/v, o and down projections are 0.7-1.8 MB each in bf16).

`to_huge_pages` copies a set of tensors into one anonymous private mapping, aligned to 2 MiB and advised
``MADV_HUGEPAGE``, and returns views of it: the same values bit for bit, the same shapes and strides (each
tensor must be contiguous), on other pages. The mapping lives as long as any view of it (``torch.frombuffer``
holds it). Measured with `benchmarks.rows_linear_bench --pages` (one forward's products at the default target's
shapes, each weight read from memory, 4 KiB and 2 MiB pages in turn; docs/results-log.md §48): on a 2-core Zen 4
EPYC at 2 threads and 1 row, bf16 1.04-1.07x faster, float32 1.01-1.02x; the packed 4/8-bit copies, bound by
widening rather than by reading, gain nothing measurable. More rows gain nothing either (x0.99-1.01 at 4 and 16).

``DRAFTSMITH_HUGEPAGES=0`` turns it off (for side-by-side runs). Elsewhere than Linux, or where the kernel's
setting is ``never``, `to_huge_pages` returns None and callers keep their tensors.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

HUGE = 2 << 20  # the x86-64 and arm64 (4 KiB base pages) transparent huge page
ALIGN = 64  # each tensor's start within the mapping: a cache line (the kernels' vector loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_setting() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``); None where there is none
    to read (not Linux, or a kernel without THP)."""
    try:
        m = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def why_not() -> str | None:
    """Why `to_huge_pages` would do nothing here (None when it would map huge pages)."""
    if os.environ.get("DRAFTSMITH_HUGEPAGES", "1") == "0":
        return "DRAFTSMITH_HUGEPAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return "this platform has no MADV_HUGEPAGE"
    mode = thp_setting()
    if mode is None:
        return f"no transparent huge pages on this kernel ({THP_SETTING} unreadable)"
    if mode == "never":
        return f"transparent huge pages are off ({THP_SETTING}: never)"
    return None


@dataclass
class Placed:
    """What `to_huge_pages` did: the views (in the order given), the mapping's address and size."""

    tensors: list[torch.Tensor]
    address: int
    nbytes: int

    def huge_bytes(self) -> int | None:
        """Bytes of the mapping the kernel backs by huge pages now (``AnonHugePages`` in /proc/self/smaps);
        None where smaps cannot be read."""
        region = smaps_region(self.address)
        return None if region is None else region.get("AnonHugePages", 0)

    def advised(self) -> bool:
        """The mapping carries the huge page advice (``hg`` in its smaps ``VmFlags``)."""
        region = smaps_region(self.address)
        return bool(region) and "hg" in region.get("VmFlags", ())


def to_huge_pages(tensors: list[torch.Tensor]) -> Placed | None:
    """Copies of ``tensors`` (contiguous CPU tensors) in one 2 MiB-aligned anonymous mapping advised
    ``MADV_HUGEPAGE``; None (nothing copied) where `why_not` gives a reason or there is nothing to place."""
    if why_not() is not None or not tensors:
        return None
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"to_huge_pages takes contiguous CPU tensors, got {t.device} "
                             f"{'contiguous' if t.is_contiguous() else 'strided'} {tuple(t.shape)}")
    sizes = [t.numel() * t.element_size() for t in tensors]
    spans = [-(-s // ALIGN) * ALIGN for s in sizes]
    total = -(-sum(spans) // HUGE) * HUGE
    # private and anonymous: shared anonymous memory would be shmem, whose huge pages follow another setting
    m = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping for as long as any view of it lives
    start = (-whole.data_ptr()) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE, start, total)  # before the first touch: the copies below fault in huge pages
    out, off = [], start
    with torch.no_grad():
        for t, s, span in zip(tensors, sizes, spans):
            v = whole[off:off + s].view(t.dtype).view(t.shape)
            v.copy_(t)
            out.append(v)
            off += span
    return Placed(out, whole.data_ptr() + start, total)


def smaps_region(address: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping that holds ``address``: ``range`` (its first and past-the-end
    addresses), its sizes in bytes, ``VmFlags`` as a tuple; None where smaps cannot be read or no mapping holds
    it."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    region = None
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if region is not None:
                return region
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            region = {"range": (lo, hi)} if lo <= address < hi else None
        elif region is not None:
            key, _, value = line.partition(":")
            if key == "VmFlags":
                region[key] = tuple(value.split())
            elif value.strip().endswith("kB"):
                region[key] = int(value.split()[0]) * 1024
    return region
