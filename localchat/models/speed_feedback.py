"""Real turns correct the calibration: a model whose turns keep running at a speed its
prediction missed by more than ``DISAGREE`` updates the figures it is priced by.

Calibration is a few seconds of generated models; a user's turns are the real thing. Each
local turn long enough to time (``MIN_TOKENS`` generated) is compared with what the saved
calibration predicts for that file at that fill; after ``TURNS`` such turns in a row that
miss on the same side, the costs of the weight types the file is made of (and the fixed cost
of a token) are scaled by their median miss, so the next plan prices that file as it ran.
Plain data in, a JSON file beside the calibration: no llama.cpp here.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from localchat.atomic import write_atomic
from localchat.models.speed import SpeedModel, load_speed_model

DISAGREE = 0.35
TURNS = 3
MIN_TOKENS = 16
MINOR_SHARE = 0.05  # weight types under this share of a file's bytes are left as they are


@dataclass(frozen=True)
class TurnSpeed:
    """What a local turn read and how fast it generated."""

    model: str  # the file's path: misses are counted per file
    work_by_type: dict[str, int]  # what one token costs (speed.token_work; CPU only)
    kv_bytes_per_token: int
    filled: int  # KV positions behind the generated tokens, on average
    generated_tokens: int
    gen_tps: float
    threads: int  # what generated it: a turn on other threads than measured says nothing


def note_turn(calibration: Path, log: Path, turn: TurnSpeed) -> str | None:
    """Count ``turn`` against the saved calibration; returns a one-line notice when it
    updated the figures, else None. A turn too short to time, or a machine without a
    calibration, changes nothing."""
    speed = load_speed_model(calibration)
    if speed is None or turn.generated_tokens < MIN_TOKENS or turn.gen_tps <= 0:
        return None
    if turn.threads != speed.threads:
        return None
    prediction = speed.predict(turn.work_by_type, turn.kv_bytes_per_token, turn.filled)
    if prediction is None or prediction.gen_tps <= 0:
        return None
    ratio = turn.gen_tps / prediction.gen_tps
    misses = _load(log)
    recent = [*misses.get(turn.model, []), ratio][-TURNS:]
    misses[turn.model] = recent
    update = len(recent) == TURNS and (
        all(r > 1 + DISAGREE for r in recent) or all(r < 1 / (1 + DISAGREE) for r in recent)
    )
    if update:
        factor = statistics.median(recent)
        corrected(speed, turn.work_by_type, factor).save(calibration)
        misses.pop(turn.model)
    write_atomic(log, json.dumps(misses, indent=2).encode())
    if not update:
        return None
    return (
        f"{Path(turn.model).name} kept generating at {turn.gen_tps:.1f} tok/s where"
        f" {prediction.gen_tps:.1f} was predicted: this machine's speed figures were updated"
    )


def corrected(speed: SpeedModel, work_by_type: dict[str, int], factor: float) -> SpeedModel:
    """``speed`` with the generation costs of the weight types this file is made of (as the
    model prices them; not the norms, under ``MINOR_SHARE`` of its bytes, which would move
    F16's price for every model) and of a token's fixed part divided by ``factor``
    (measured over predicted tok/s)."""
    gen = dict(speed.gen_s_per_byte)
    total = max(1, sum(work_by_type.values()))
    major = [t for t, n in work_by_type.items() if n >= MINOR_SHARE * total]
    for weight_type in {speed.cost_key(gen, t) for t in major}:
        gen[weight_type] /= factor
    return SpeedModel(
        gen,
        speed.gen_overhead_s / factor,
        speed.prompt_s_per_byte,
        speed.prompt_overhead_s,
        speed.machine,
        speed.threads,
        speed.measured,
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
