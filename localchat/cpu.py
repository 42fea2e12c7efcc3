"""This machine's processor: how many threads llama.cpp should run (a leaf module)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil


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
