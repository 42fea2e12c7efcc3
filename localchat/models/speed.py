"""How fast a model runs on this machine: a calibrated cost per byte of each weight type.

Generating a token reads every weight matrix once (the token embeddings only by row), so its
time is a fixed part (graph, sampling) plus, for each ggml weight type, the bytes of that type
times what a byte costs here. That cost is not bandwidth alone: on a few cores, dequantizing
a K-quant costs more time per byte than streaming F16 does, so it is measured (calibrate.py),
not derived. Prefill is modelled the same way with its own costs (batched, compute-bound).
Reading the KV cache of the filled context costs like F16 weights. Layers on a GPU cost their
bytes over the GPU's memory bandwidth, when that is known.

This module holds the figures and the arithmetic; it imports no llama.cpp and no numpy.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from localchat.atomic import write_atomic
from localchat.cpu import cpu_model, physical_cores
from localchat.gguf.quants import MAIN_WEIGHT_TYPE, parse_tag

# 2: measured in interleaved rounds that contention cannot poison (older figures may be).
SPEED_FILE_VERSION = 2
# A generation reads weights at this share of the GPU's peak bandwidth (what llama.cpp's CUDA
# and Metal kernels reach in practice on a single stream).
GPU_BANDWIDTH_EFFICIENCY = 0.6
# Weight types calibration does not measure cost like one it does (llama.cpp's CPU kernels
# for them are of the same kind): BF16 like F16, the IQ types like the K-quants they sit by.
SIMILAR_TYPE: dict[str, str] = {
    "F32": "F16",
    "BF16": "F16",
    "Q8_1": "Q8_0",
    "Q5_1": "Q5_0",
    "Q4_1": "Q4_0",
    "MXFP4": "Q4_0",
    "IQ4_NL": "Q4_0",
    "IQ4_XS": "Q4_K",
    "Q5_K": "Q6_K",
    "IQ3_S": "Q3_K",
    "IQ3_XXS": "Q3_K",
    "IQ2_S": "Q2_K",
    "IQ2_XS": "Q2_K",
    "IQ2_XXS": "Q2_K",
    "IQ1_M": "Q2_K",
    "IQ1_S": "Q2_K",
    "TQ1_0": "Q2_K",
    "TQ2_0": "Q2_K",
}
# How a file type's matrices split between weight types, for files known only by size
# (catalog entries): llama.cpp's quantizer keeps attn_v, part of ffn_down and the output a
# step up. A local file's own tensor list replaces this.
FILE_TYPE_MIX: dict[str, dict[str, float]] = {
    "Q4_K_M": {"Q4_K": 0.75, "Q6_K": 0.25},
    "Q4_K_S": {"Q4_K": 0.9, "Q6_K": 0.1},
    "Q5_K_M": {"Q5_K": 0.8, "Q6_K": 0.2},
    "Q3_K_M": {"Q3_K": 0.75, "Q4_K": 0.2, "Q6_K": 0.05},
    "Q3_K_L": {"Q3_K": 0.6, "Q5_K": 0.35, "Q6_K": 0.05},
    "Q2_K": {"Q2_K": 0.5, "Q3_K": 0.35, "Q4_K": 0.1, "Q6_K": 0.05},
}


@dataclass(frozen=True)
class SpeedPrediction:
    gen_tps: float
    prompt_tps: float


@dataclass(frozen=True)
class SpeedModel:
    """Seconds per byte of each weight type here, for generation and for prefill."""

    gen_s_per_byte: dict[str, float]
    gen_overhead_s: float
    prompt_s_per_byte: dict[str, float]
    prompt_overhead_s: float
    machine: str  # what it was measured on: calibrations do not travel between machines
    threads: int
    measured: dict[str, dict[str, float]] = field(default_factory=dict)  # file -> tok/s seen
    version: int = SPEED_FILE_VERSION

    @staticmethod
    def cost_key(table: Mapping[str, float], weight_type: str) -> str:
        """The measured type a weight type is priced as: itself, a similar one, or (unknown)
        the slowest measured."""
        if weight_type in table:
            return weight_type
        similar = SIMILAR_TYPE.get(weight_type, "")
        if similar in table:
            return similar
        return max(table, key=lambda t: table[t])

    def _cost(self, table: Mapping[str, float], weight_type: str) -> float:
        return table[self.cost_key(table, weight_type)]

    def predict(
        self,
        bytes_by_type: Mapping[str, int],
        kv_bytes_per_token: int = 0,
        n_filled: int = 0,
        gpu_bytes: int = 0,
        gpu_bandwidth: float = 0.0,
    ) -> SpeedPrediction | None:
        """Tokens/s for a model that reads ``bytes_by_type`` per token on the CPU (and
        ``gpu_bytes`` on a GPU), with ``n_filled`` positions of KV cache behind it. None
        when part of it is on a GPU of unknown bandwidth."""
        if gpu_bytes and gpu_bandwidth <= 0:
            return None
        gpu_s = gpu_bytes / (gpu_bandwidth * GPU_BANDWIDTH_EFFICIENCY) if gpu_bytes else 0.0
        kv_s = kv_bytes_per_token * n_filled * self._cost(self.gen_s_per_byte, "F16")
        gen = self.gen_overhead_s + gpu_s + kv_s
        gen += sum(n * self._cost(self.gen_s_per_byte, t) for t, n in bytes_by_type.items())
        prompt = self.prompt_overhead_s + gpu_s / 8  # a GPU batch reads its weights once
        prompt += sum(n * self._cost(self.prompt_s_per_byte, t) for t, n in bytes_by_type.items())
        return SpeedPrediction(1.0 / gen, 1.0 / prompt)

    def save(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def load(cls, path: Path, machine: str) -> SpeedModel | None:
        """The calibration saved for this machine, or None (none yet, another machine, an
        older format, an unreadable file: calibrate again)."""
        try:
            data = json.loads(path.read_text())
            model = cls(**data)
        except (OSError, ValueError, TypeError):
            return None
        if model.version != SPEED_FILE_VERSION or model.machine != machine:
            return None
        return model


def bytes_by_type_of_size(quant: str, read_bytes: int) -> dict[str, int]:
    """A file known only by its type and the bytes a token reads: split as its type is made."""
    parsed = parse_tag(quant)
    base = parsed.base if parsed else quant.upper()
    mix = FILE_TYPE_MIX.get(base)
    if mix is None:
        return {MAIN_WEIGHT_TYPE.get(base, "Q4_K"): read_bytes}
    return {weight_type: int(read_bytes * share) for weight_type, share in mix.items()}


def machine_name() -> str:
    """What a calibration is valid for: the processor, its cores and the llama.cpp build."""
    try:
        build = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        build = "unknown"
    return f"{cpu_model()} · {physical_cores()} cores · {platform.machine()} · llama.cpp {build}"


def load_speed_model(path: Path) -> SpeedModel | None:
    """This machine's saved calibration, if it has one."""
    return SpeedModel.load(path, machine_name())
