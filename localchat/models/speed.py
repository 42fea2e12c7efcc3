"""How fast a model runs on this machine: a calibrated cost per byte of each weight type.

Generating a token reads every weight matrix once (the token embeddings only by row), so its
time is a fixed part (graph, sampling) plus, for each ggml weight type, the bytes of that type
times what a byte costs here. That cost is not bandwidth alone: on a few cores, dequantizing
a K-quant costs more time per byte than streaming F16 does, so it is measured (calibrate.py),
not derived. Each row of a matrix also has a fixed cost, so a matrix's bytes count weighted
by its row length (``token_work``), in the calibration and in every prediction alike.
Prefill is modelled the same way with its own costs (batched, compute-bound) over the
matrices a prompt token passes through: llama.cpp computes the output matrix and the last
layer's feed-forward only for the tokens whose logits are wanted.
Attention over the filled context has its own measured price (``attention_work``,
models/attention_cost.py): every query head takes a dot product with each position's key and
adds its value, so a grouped-query model does its KV cache's arithmetic once per query head,
not once per KV head (7 times over for Qwen2.5-0.5B's 14 heads on 2), at about twice the
price of F16 weights: a 2-core EPYC's 0.5b and 1b models ran 13-35% under predictions that
priced the cache's bytes once as weights. Layers on a GPU cost their
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
from localchat.gguf.estimate import ModelDims
from localchat.gguf.info import GGUFInfo, read_gguf
from localchat.gguf.quants import MAIN_WEIGHT_TYPE, parse_tag

# 2: measured in interleaved rounds that contention cannot poison (older figures may be).
# 3: files past the processor's cache, of a 1.5B model's row lengths, bytes weighted by rows.
# 4: what a step of several tokens costs, per weight type (one figure for all before).
# 5: files past 40% of a big processor cache (timed 1.4-2x too fast inside it), read in
# fewer tokens there; a prompt token priced as what it adds to a batch.
# 6: the readings' attention (over every query head) is part of what their F16 cost prices.
SPEED_FILE_VERSION = 6
# Tokens in the steps the calibration times with every position's logits (a draft's
# verification: the token before the draft plus the drafted ones, up to 8).
STEP_SIZES = (1, 2, 3, 5, 9)
# A row's dot product costs this many weights' worth of time besides its bytes (the
# activations' block sums, the horizontal add, the store). Measured on llama.cpp's CPU
# kernels (2-core Xeon, files of 1024- and 4096-wide rows): ~250 weights for Q2_K, ~450 for
# Q6_K, ~780 for Q4_K; so a byte of an 896-wide row (Qwen2.5-0.5B) costs ~1.3x what one of a
# 4096-wide row (a 7B) does. Without it the 0.5b demo models predicted up to 26% too fast.
ROW_COST_WEIGHTS = 400
# The row length assumed for a file known only by its size (catalog entries): 1B-3B models'.
TYPICAL_ROW = 2048
F16_BYTES = 2  # attention's keys and values are F16 (or converted to it) in llama.cpp's kernels
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
    # A step of n tokens (a draft's verification) in single steps, by n (``step_costs``);
    # None: not calibrated, or part of the model is on a GPU (its curve is not measured).
    step_costs: dict[int, float] | None = None


@dataclass(frozen=True)
class SpeedModel:
    """Seconds per byte of each weight type here (of ``token_work``), for generation and for
    prefill."""

    gen_s_per_byte: dict[str, float]
    gen_overhead_s: float
    prompt_s_per_byte: dict[str, float]
    prompt_overhead_s: float
    machine: str  # what it was measured on: calibrations do not travel between machines
    threads: int
    measured: dict[str, dict[str, float]] = field(default_factory=dict)  # file -> tok/s seen
    version: int = SPEED_FILE_VERSION
    # Seconds a step of each of ``STEP_SIZES`` tokens costs, per byte of each weight type
    # (of ``token_work``) and its fixed part: the curve differs by type more than by size
    # (measured on 2 cores: Q4_0 and Q5_0 cost almost nothing more for 4 tokens than for
    # one, being memory-bound, where Q4_K costs 2x and SmolLM2 (Q4_1, priced as Q4_0) 2.4x
    # for 5: the engine times its own steps and corrects the curve within a few).
    step_s_per_byte: dict[str, list[float]] = field(default_factory=dict)
    step_overhead_s: list[float] = field(default_factory=list)
    # Seconds per byte of attention work (``attention_work``; models/attention_cost.py);
    # 0: not timed, priced as F16 weights.
    attention_s_per_byte: float = 0.0
    # Files whose turns corrected the generation figures (speed_feedback.py), by name: the
    # factor their speed was found at against the prediction, all corrections multiplied.
    corrections: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for `hw`: what the speeds come from."""
        line = f"calibrated on this machine ({self.threads} threads)"
        if self.corrections:
            found = ", ".join(f"{name} x{factor:.2f}" for name, factor in self.corrections.items())
            line += f", corrected from use ({found})"
        return line

    @staticmethod
    def cost_key(table: Mapping[str, float] | Mapping[str, list[float]], weight_type: str) -> str:
        """The measured type a weight type is priced as: itself, a similar one, or (unknown)
        the slowest measured (of a step curve: at its largest step)."""
        if weight_type in table:
            return weight_type
        similar = SIMILAR_TYPE.get(weight_type, "")
        if similar in table:
            return similar
        return max(table, key=lambda t: _largest(table[t]))

    def _cost(self, table: Mapping[str, float], weight_type: str) -> float:
        return table[self.cost_key(table, weight_type)]

    def predict(
        self,
        work_by_type: Mapping[str, int],
        attention: int = 0,
        gpu_bytes: int = 0,
        gpu_bandwidth: float = 0.0,
        prompt_work: Mapping[str, int] | None = None,
    ) -> SpeedPrediction | None:
        """Tokens/s for a model whose token costs ``work_by_type`` on the CPU (``token_work``; a
        prompt token ``prompt_work``, else the same; ``gpu_bytes`` on a GPU), attending as
        much of its context as ``attention`` says (``attention_work``). None when part of it
        is on a GPU of unknown bandwidth."""
        if gpu_bytes and gpu_bandwidth <= 0:
            return None
        gpu_s = gpu_bytes / (gpu_bandwidth * GPU_BANDWIDTH_EFFICIENCY) if gpu_bytes else 0.0
        gen = self.gen_overhead_s + gpu_s + self.attention_s(attention)
        gen += sum(n * self._cost(self.gen_s_per_byte, t) for t, n in work_by_type.items())
        prompt = self.prompt_overhead_s + gpu_s / 8  # a GPU batch reads its weights once
        prompt_work = work_by_type if prompt_work is None else prompt_work
        prompt += sum(n * self._cost(self.prompt_s_per_byte, t) for t, n in prompt_work.items())
        steps = None if gpu_bytes else self.step_costs(work_by_type)
        return SpeedPrediction(1.0 / gen, 1.0 / prompt, steps)

    def attention_s(self, attention: int) -> float:
        """What ``attention`` (``attention_work``) costs a token here."""
        price = self.attention_s_per_byte or self._cost(self.gen_s_per_byte, "F16")
        return attention * price

    def step_costs(self, work_by_type: Mapping[str, int]) -> dict[int, float] | None:
        """What a step of each of ``STEP_SIZES`` tokens costs in single-token steps, for a
        model whose token costs ``work_by_type`` on the CPU: never less than a smaller
        step's (a faster batch kernel measures as a flat stretch). None: not measured."""
        if not self.step_overhead_s or not self.step_s_per_byte:
            return None
        seconds = list(self.step_overhead_s)
        for weight_type, n_bytes in work_by_type.items():
            per_byte = self.step_s_per_byte[self.cost_key(self.step_s_per_byte, weight_type)]
            seconds = [s + n_bytes * b for s, b in zip(seconds, per_byte, strict=True)]
        costs, floor = {}, 1.0
        for size, step_s in zip(STEP_SIZES, seconds, strict=True):
            floor = max(floor, step_s / seconds[0])
            costs[size] = floor
        return costs

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


@dataclass(frozen=True)
class TokenWork:
    """What a generated token and a prompt token cost, by weight type (``token_work``)."""

    gen: dict[str, int]
    prompt: dict[str, int]

    @classmethod
    def of(cls, info: GGUFInfo) -> TokenWork:
        return cls(token_work(info), token_work(info, prompt=True))

    def scaled(self, share: float) -> TokenWork:
        """The part of it a CPU does when ``1 - share`` of the weights are on a GPU."""
        return TokenWork(
            {t: int(n * share) for t, n in self.gen.items()},
            {t: int(n * share) for t, n in self.prompt.items()},
        )


def token_work(info: GGUFInfo, prompt: bool = False) -> dict[str, int]:
    """What one token costs, by weight type: the bytes it reads (every matrix, of the token
    embeddings only a row unless they double as the output), each matrix's weighted by its
    row length (``ROW_COST_WEIGHTS``). What the speed model's per-byte costs price.

    ``prompt``: a prompt token's, without the matrices llama.cpp runs only for the tokens whose
    logits are wanted (the output matrix, the last layer's feed-forward): in a one-layer
    calibration file that is most of its bytes."""
    tied = not any(t.name == "output.weight" for t in info.tensors)
    output = "token_embd.weight" if tied else "output.weight"
    last_ffn = f"blk.{info.n_layer - 1}.ffn_"
    work: dict[str, float] = {}
    for tensor in info.tensors:
        if tensor.name.startswith("token_embd") and not tied:
            continue
        if prompt and (tensor.name == output or tensor.name.startswith(last_ffn)):
            continue
        row = tensor.shape[0] if len(tensor.shape) > 1 else 0
        work[tensor.ggml_type] = work.get(tensor.ggml_type, 0.0) + tensor.n_bytes * _row_factor(row)
    return {weight_type: round(n) for weight_type, n in work.items()}


def attention_work(dims: ModelDims, n_filled: int) -> int:
    """The work of a generated token's attention over ``n_filled`` positions, in bytes of
    F16 keys and values as every query head reads them (a sliding-window layer over its
    window at most): grouped-query attention shares the cache between heads, not the
    arithmetic. ``SpeedModel.attention_s_per_byte`` prices it."""
    windowed = dims.window_layers()
    positions = (dims.n_layer - windowed) * n_filled
    positions += windowed * min(n_filled, dims.sliding_window or n_filled)
    return positions * dims.n_head * (dims.head_dim_k + dims.head_dim_v) * F16_BYTES


def _row_factor(row_length: int) -> float:
    """How much a byte of a matrix with rows this long costs against pure streaming (1.0 for
    vectors: norms have no dot products)."""
    return (row_length + ROW_COST_WEIGHTS) / row_length if row_length else 1.0


def work_of_size(quant: str, read_bytes: int) -> TokenWork:
    """``TokenWork`` for a file known only by its type and the bytes a token reads: split as
    its type is made, of typical row length (a prompt token's taken as the same)."""
    parsed = parse_tag(quant)
    base = parsed.base if parsed else quant.upper()
    work = read_bytes * _row_factor(TYPICAL_ROW)
    mix = FILE_TYPE_MIX.get(base) or {MAIN_WEIGHT_TYPE.get(base, "Q4_K"): 1.0}
    by_type = {weight_type: round(work * share) for weight_type, share in mix.items()}
    return TokenWork(by_type, by_type)


def _largest(cost: float | list[float]) -> float:
    return cost[-1] if isinstance(cost, list) else cost


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


def calibrated_step_costs(calibration: Path, model: Path) -> dict[int, float] | None:
    """What this machine's saved calibration predicts a step of n tokens costs on ``model``
    (a draft's verification, in single steps): the drafting policy's prior. None without a
    calibration, or where it cannot tell."""
    speed = load_speed_model(calibration)
    return speed.step_costs(token_work(read_gguf(model))) if speed else None
