"""What this machine has: cores now; RAM and VRAM come with the planning issue."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil


def physical_cores() -> int:
    """Physical cores: llama.cpp runs fastest with one thread per physical core."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def repacked_weight_types() -> frozenset[str]:
    """Weight types llama.cpp's CPU backend repacks on this processor (its faster kernels
    need an interleaved copy). x86 with AVX2 and ARM with NEON dot products have them."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return X86_REPACKED if "avx2" in _cpu_flags() else frozenset()
    if machine in ("arm64", "aarch64"):
        return ARM_REPACKED
    return frozenset()


X86_REPACKED = frozenset({"Q4_0", "Q4_K", "Q2_K", "IQ4_NL"})
ARM_REPACKED = frozenset({"Q4_0", "IQ4_NL"})


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
