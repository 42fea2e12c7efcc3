"""This machine's processor: its cores (how many threads llama.cpp should run), flags and
cache (a leaf module)."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import psutil

from localchat.errors import UsageError
from localchat.units import parse_size


def physical_cores() -> int:
    """Physical cores: llama.cpp runs fastest with one thread per physical core."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def cpuinfo(field: str) -> str | None:
    """A field of the first processor in /proc/cpuinfo (Linux), or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def cpu_flags() -> set[str]:
    """The processor's feature flags (avx2, avx512f, …); empty where unknown."""
    return set((cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """The processor's name, as a calibration is keyed by it."""
    return cpuinfo("model name") or platform.processor() or "unknown processor"


@functools.cache
def caches() -> dict[str, int]:
    """The processor's caches by name (``L1d``, ``L1i``, ``L2``, ``L3``) and bytes, as the
    system reports them (Linux sysfs; on a virtual machine, the host's: a shared cache is
    shared with its other tenants); empty where it is not told."""
    found: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:  # sysfs spells sizes as ``32768K``: binary units, as parse_size reads them
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError, UsageError):
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        found[f"L{level}{suffix}"] = size
    return found


def last_level_cache_bytes() -> int:
    """The size of the processor's last-level cache (``caches``), or 0 where it is not told."""
    levels = {name[1]: size for name, size in caches().items() if not name.endswith("i")}
    return levels[max(levels)] if levels else 0


# The instruction sets llama.cpp's CPU kernels choose between, as /proc/cpuinfo names them.
KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "f16c",
    "fma",
)


def cpu_description() -> dict[str, object]:
    """What a benchmark's figures were measured on: the processor, cores, caches and the
    kernel-choosing flags it has (tuned figures do not travel between processors)."""
    flags = cpu_flags()
    return {
        "model": cpu_model(),
        "cores": physical_cores(),
        "caches": caches(),
        "flags": [flag for flag in KERNEL_FLAGS if flag in flags],
    }
