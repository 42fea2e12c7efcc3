"""What llama.cpp allocated for a model and its context, read from the lines it logs."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheBuffer:
    """One KV cache llama.cpp allocated (a sliding-window model has two)."""

    cells: int
    layers: int
    bytes: int


@dataclass(frozen=True)
class Buffers:
    """What llama.cpp allocated for a model and its context, as it reported it."""

    weights: dict[str, int]  # by buffer type: CPU_Mapped, CPU_REPACK, CUDA0, …
    kv: tuple[KVCacheBuffer, ...]
    compute: dict[str, int]
    output: int

    @property
    def kv_bytes(self) -> int:
        return sum(cache.bytes for cache in self.kv)

    def kv_bytes_for(self, n_tokens: int) -> int:
        """Bytes the caches hold for ``n_tokens`` positions: a window cache never holds more
        than its cells."""
        return sum(c.bytes * min(n_tokens, c.cells) // max(1, c.cells) for c in self.kv)


_MIB = 1024 * 1024
_BUFFER_RE = re.compile(r"(\S+) +(model|compute|output) buffer size = +([\d.]+) MiB")
_KV_RE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")


def parse_buffers(lines: list[str], kv_bytes_per_cell_layer: int) -> Buffers:
    weights: dict[str, int] = {}
    compute: dict[str, int] = {}
    output = 0
    kv: list[KVCacheBuffer] = []
    for line in lines:
        if match := _KV_RE.search(line):
            _size, cells, layers = match.groups()
            size_bytes = int(cells) * int(layers) * kv_bytes_per_cell_layer
            kv.append(KVCacheBuffer(int(cells), int(layers), size_bytes))
        elif match := _BUFFER_RE.search(line):
            device, kind, size = match.groups()
            value = int(float(size) * _MIB)
            if kind == "model":
                weights[device] = weights.get(device, 0) + value
            elif kind == "compute":
                compute[device] = value  # the last reservation is the one kept
            else:
                output += value
    return Buffers(weights, tuple(kv), compute, output)
