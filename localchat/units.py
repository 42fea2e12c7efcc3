"""Figures for people: byte sizes formatted and parsed (``8GiB``, ``8G``, ``8192MiB``,
``8000000000``) and counts of things (``1 token``, ``2,013 tokens``)."""

from __future__ import annotations

import re

from localchat.errors import UsageError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1536`` → ``1.5 KiB``; one decimal, binary units."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_SIZE_SUFFIXES = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """``8GiB``, ``8G`` (binary), ``8GB`` (decimal), ``8192MiB``, ``8000000000`` → bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    suffix = match.group(2).lower() if match else ""
    if match is None or suffix not in _SIZE_SUFFIXES:
        raise UsageError(f"{text!r} is not a size; write it like 8GiB, 8G, 8192MiB or 8000000000")
    return int(float(match.group(1)) * _SIZE_SUFFIXES[suffix])


def count(n: int, noun: str) -> str:
    """``1, "token"`` → ``1 token``; ``2013, "token"`` → ``2,013 tokens``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float) -> float:
    """A keep-alive as Ollama takes it: seconds as a number, or ``"10m"``, ``"1h30m"``,
    ``"45s"`` (Go's duration units ms, s, m, h; a bare number is seconds). Negative: forever
    (returned as -1); 0: at once."""
    if isinstance(value, bool):
        raise UsageError(f"{value!r} is not a duration; write it like 10m, 1h, 30s, 0 or -1")
    if isinstance(value, int | float):
        return -1.0 if value < 0 else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if re.fullmatch(r"\d+(\.\d+)?", body):
        seconds = float(body)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", body)
        if not parts or "".join(n + u for n, u in parts) != body:
            raise UsageError(f"{value!r} is not a duration; write it like 10m, 1h, 30s, 0 or -1")
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    return -1.0 if sign < 0 and seconds > 0 else seconds
