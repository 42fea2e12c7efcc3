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
def last_level_cache_bytes() -> int:
    """The size of the processor's last-level cache as the system reports it (Linux sysfs;
    on a virtual machine, the host's whole cache, shared with its other tenants), or 0 where
    it is not told."""
    levels: dict[int, int] = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:  # sysfs spells sizes as ``32768K``: binary units, as parse_size reads them
            levels[int((index / "level").read_text())] = parse_size((index / "size").read_text())
        except (OSError, ValueError, UsageError):
            continue
    return levels[max(levels)] if levels else 0
