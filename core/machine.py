"""The machine and the code a result was measured on: CPU model and instruction sets, memory, git commit.

Every speed figure draftsmith prints depends on the CPU (AVX2 only, AVX-512, AMX), so reports carry these
facts beside the numbers (`draftsmith.checkpoint.environment` adds them to every result).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: Instruction-set flag prefixes that decide which kernels run (llama.cpp's and oneDNN's choices follow them).
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "bmi")


def cpu_stamp(cpuinfo: str | None = None) -> dict:
    """This CPU's model name and instruction-set flags (``/proc/cpuinfo``; empty where it does not exist)."""
    if cpuinfo is None:
        p = Path("/proc/cpuinfo")
        cpuinfo = p.read_text() if p.exists() else ""
    model, flags, family, number = "", [], None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = sorted(value.split())
        elif key == "cpu family" and family is None:
            family = value.strip()
        elif key == "model" and number is None:
            number = value.strip()
    isa = [f for f in flags if f.startswith(ISA_PREFIXES)]
    return {"cpu_model": model, "cpu_family": family, "cpu_model_number": number, "cpu_isa": isa}


def cpu_kind(stamp: dict) -> str:
    """A short name of the CPU's class for tables: its model name and the widest vector unit it has."""
    isa = set(stamp.get("cpu_isa") or ())
    unit = ("AMX" if "amx_tile" in isa else "AVX-512" if "avx512f" in isa else "AVX2 only" if "avx2" in isa
            else "no AVX2")
    return f"{stamp.get('cpu_model') or 'unknown CPU'} ({unit})"


def memory_gib() -> float | None:
    """Physical memory in GiB (None where it cannot be read)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def git_commit(where: str | Path | None = None) -> dict | None:
    """The commit of the git checkout the package runs from (short hash, and whether the tree had changes),
    or None outside a checkout (an installed wheel)."""
    root = Path(where) if where is not None else Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def machine() -> dict:
    """Everything about this machine a speed figure depends on, for the ``environment`` of a result."""
    stamp = cpu_stamp()
    return {**stamp, "cpu_kind": cpu_kind(stamp), "cpu_count": os.cpu_count(), "memory_gib": memory_gib()}
