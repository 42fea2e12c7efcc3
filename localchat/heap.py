"""The process's heap (a leaf module): after a model is unloaded, glibc keeps the freed
pages of its buffers for reuse, so the resident memory the user sees would not go down;
``malloc_trim`` hands them back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to hand back
        return None
    return trim


def release_free_heap() -> None:
    """Return the heap's free pages to the system (glibc; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
