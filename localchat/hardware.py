"""What this machine has: cores now; RAM and VRAM come with the planning issue."""

from __future__ import annotations

import os

import psutil


def physical_cores() -> int:
    """Physical cores: llama.cpp runs fastest with one thread per physical core."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1
