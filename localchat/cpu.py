"""This machine's processor: how many threads llama.cpp should run (a leaf module)."""

from __future__ import annotations

import os

import psutil


def physical_cores() -> int:
    """Physical cores: llama.cpp runs fastest with one thread per physical core."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1
