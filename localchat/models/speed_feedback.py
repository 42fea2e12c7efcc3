"""Real turns correct the calibration: a model whose recent turns run, by their median, more
than ``DISAGREE`` off its prediction updates the figures it is priced by.

Calibration is a few seconds of generated models; a user's turns are the real thing. Each
local turn long enough to time (``MIN_TOKENS`` generated), whose threads had the CPU (the
calibration's own rule, ``MIN_CPU_SHARE``), is compared with what the saved calibration
predicts for that file at that fill. Once ``MIN_TURNS`` of the last ``TURNS`` such turns are
in, their median decides: more than ``DISAGREE`` off and the costs of the weight types the
file is made of (and the fixed cost of a token) are scaled by it, so the next plan prices
that file as it ran. A median, not a mean: one turn beside a busy neighbour cannot move it.
A machine 15% off is corrected by its third timed turn, and within five even when two of
them were slowed. Plain data in, a JSON file beside the calibration: no llama.cpp here
(``note_turn_speed`` reads a loaded engine's figures, handed it).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from localchat.atomic import write_atomic
from localchat.backends.base import Backend, TurnStats
from localchat.gguf.estimate import ModelDims
from localchat.models.calibrate import MIN_CPU_SHARE
from localchat.models.speed import SpeedModel, attention_work, load_speed_model, token_work
from localchat.paths import AppPaths

DISAGREE = 0.10
TURNS = 5  # the recent turns whose median is judged
MIN_TURNS = 3  # a median of fewer is one turn's word
MIN_TOKENS = 16
MINOR_SHARE = 0.05  # weight types under this share of a file's bytes are left as they are


@dataclass(frozen=True)
class TurnSpeed:
    """What a local turn read and how fast it generated."""

    model: str  # the file's path: misses are counted per file
    work_by_type: dict[str, int]  # what one token costs (speed.token_work; CPU only)
    attention: int  # its attention at the turn's mean fill (speed.attention_work)
    generated_tokens: int
    gen_tps: float
    threads: int  # what generated it: a turn on other threads than measured says nothing
    cpu_share: float = 1.0  # of threads x the generation's wall time, as calibration reads it


def note_turn_speed(paths: AppPaths, backend: Backend, stats: TurnStats) -> str | None:
    """Count a local CPU turn's speed against the calibration; a notice when the figures
    were updated. Servers and GPU offload are not what it measures."""
    from localchat.backends.llama.engine import Engine  # only a loaded engine gets here

    if not isinstance(backend, Engine) or backend.options.n_gpu_layers:
        return None
    if stats.drafted_tokens:  # drafts sped it up: not what the calibration predicts
        return None
    filled = stats.prompt_tokens + stats.generated_tokens // 2
    turn = TurnSpeed(
        str(backend.model_path),
        token_work(backend.info),
        attention_work(ModelDims.from_gguf(backend.info), filled),
        stats.generated_tokens,
        stats.gen_tps,
        backend.threads,
        1.0 if stats.gen_cpu_share is None else stats.gen_cpu_share,
    )
    return note_turn(paths.speed_calibration, paths.turn_speeds, turn)


def note_turn(calibration: Path, log: Path, turn: TurnSpeed) -> str | None:
    """Count ``turn`` against the saved calibration; returns a one-line notice when it
    updated the figures, else None. A turn too short to time, one that did not have the
    CPU, or a machine without a calibration changes nothing."""
    speed = load_speed_model(calibration)
    if speed is None or turn.generated_tokens < MIN_TOKENS or turn.gen_tps <= 0:
        return None
    if turn.threads != speed.threads or turn.cpu_share < MIN_CPU_SHARE:
        return None
    prediction = speed.predict(turn.work_by_type, turn.attention)
    if prediction is None or prediction.gen_tps <= 0:
        return None
    misses = _load(log)
    recent = [*misses.get(turn.model, []), turn.gen_tps / prediction.gen_tps][-TURNS:]
    misses[turn.model] = recent
    factor = statistics.median(recent)
    update = len(recent) >= MIN_TURNS and abs(factor - 1) > DISAGREE
    if update:  # every file's misses were measured against the figures it changes
        corrected(speed, turn.work_by_type, factor, Path(turn.model).name).save(calibration)
        misses = {}
    write_atomic(log, json.dumps(misses, indent=2).encode())
    if not update:
        return None
    return (
        f"{Path(turn.model).name} kept generating at {factor:.2f}x the predicted speed"
        f" ({turn.gen_tps:.1f} tok/s, {prediction.gen_tps:.1f} predicted): this machine's"
        " speed figures were corrected from use"
    )


def corrected(
    speed: SpeedModel, work_by_type: dict[str, int], factor: float, model: str = ""
) -> SpeedModel:
    """``speed`` with the generation costs of the weight types this file is made of (as the
    model prices them; not the norms, under ``MINOR_SHARE`` of its bytes, which would move
    F16's price for every model), of a token's fixed part and of attention divided by ``factor``
    (measured over predicted tok/s); ``model``'s correction is counted in ``corrections``
    (what `hw` reports). The step curves and the prompt's costs stay as measured."""
    gen = dict(speed.gen_s_per_byte)
    total = max(1, sum(work_by_type.values()))
    major = [t for t, n in work_by_type.items() if n >= MINOR_SHARE * total]
    for weight_type in {speed.cost_key(gen, t) for t in major}:
        gen[weight_type] /= factor
    corrections = dict(speed.corrections)
    if model:
        corrections[model] = round(corrections.get(model, 1.0) * factor, 4)
    return replace(
        speed,
        gen_s_per_byte=gen,
        gen_overhead_s=speed.gen_overhead_s / factor,
        attention_s_per_byte=speed.attention_s_per_byte / factor,
        corrections=corrections,
    )


def _load(log: Path) -> dict[str, list[float]]:
    try:
        data = json.loads(log.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(k): [float(x) for x in v if isinstance(x, int | float)]
        for k, v in data.items()
        if isinstance(v, list)
    }
