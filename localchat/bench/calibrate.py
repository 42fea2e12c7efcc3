"""``localchat bench --only calibrate``: a first calibration's time, and what two CPU hogs do
to the figures.

Two calibrations in one run: from nothing (the test models made too: ``calibration_first_s``,
the first start's wait; its readings are the idle machine's), and again with two busy-looping
processes beside it. The busy one must either refuse to settle (nothing would be saved) or predict every
calibration file's generation speed within ``calibration_busy_error`` of the idle one:
``calibration_busy_ok`` is 1 when either holds.

The idle calibration, where it settled, is saved as this machine's (the plan part, which runs
next, predicts from it): a virtual machine's speed drifts over hours, and a prediction from a
calibration taken long before says more about that drift than about the speed model.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat.gguf.info import read_gguf
from localchat.models.calibrate import (
    CALIBRATION_TYPES,
    CalibrationUnsettled,
    calibrate,
    keep_calibration,
)
from localchat.models.speed import STEP_SIZES, SpeedModel, machine_name, token_work
from localchat.models.timing_models import SpeedScratch
from localchat.paths import app_paths

HOGS = 2
# The busy calibration's rounds: two hogs on two cores keep most rounds from counting, and a
# calibration whose first two rounds disagree is unsettled (the app's own gives up at 40 s):
# a third round only stretched this part, never changed its verdict.
BUSY_ROUNDS = 2
BUSY_LIMIT = 0.35


def _predicted(speed: SpeedModel, work: dict[str, dict[str, int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for quant in CALIBRATION_TYPES:
        prediction = speed.predict(work[quant])
        out[quant] = prediction.gen_tps if prediction else 0.0
    return out


def _calibration_work(models: Path) -> dict[str, dict[str, int]]:
    """What a token of each calibration file reads (each written once more for its header)."""
    with SpeedScratch(models) as scratch:
        return {quant: token_work(scratch.info(quant)) for quant in CALIBRATION_TYPES}


def bench_calibrate(model_path: Path, progress: Callable[[str], None] | None) -> dict[str, Any]:
    """A first calibration's time; two CPU hogs either keep it from settling or move its
    predictions by no more than 35%."""
    say = progress or (lambda _line: None)
    with tempfile.TemporaryDirectory(prefix="localchat-calib-") as scratch:
        models = Path(scratch)
        say("calibrate: from nothing (test models made too)")
        start = time.monotonic()
        first = _settled(models)
        first_s = time.monotonic() - start
        say(f"calibrate: beside {HOGS} busy processes")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
        try:
            busy = _settled(models, BUSY_ROUNDS)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        result: dict[str, Any] = {
            "calibration_first_s": round(first_s, 1),
            "calibration_busy_saved": not isinstance(busy, str),
        }
        if isinstance(first, str):  # an idle machine that did not settle: say why
            result["calibration_idle_unsettled"] = first
            return result
        keep_calibration(app_paths(), first)  # the plan part predicts from it
        work = _calibration_work(models)
        calm = _predicted(first, work)
        result["calibration_idle_gen_tps"] = {q: round(v, 1) for q, v in calm.items()}
        # What the fit was made from, so that another version's speed model can be judged
        # on this machine's figures (tests/test_speed_machines.py does).
        result["calibration_readings"] = {
            "gen_tps": {t: m["gen_tps"] for t, m in first.measured.items()},
            "overhead_ms": round(first.gen_overhead_s * 1e3, 4),
            "attention_ps_per_byte": round(first.attention_s_per_byte * 1e12, 2),
            "step_ps_per_byte": {
                t: [round(s * 1e12, 4) for s in steps] for t, steps in first.step_s_per_byte.items()
            },
            "step_overhead_ms": [round(s * 1e3, 4) for s in first.step_overhead_s],
        }
        result.update(_step_curve_figures(first, model_path))
        if isinstance(busy, str):
            result["calibration_busy_ok"] = 1
            return result
        loaded = _predicted(busy, work)
        error = max(abs(loaded[q] - calm[q]) / calm[q] for q in calm)
        result["calibration_busy_gen_tps"] = {q: round(v, 1) for q, v in loaded.items()}
        result["calibration_busy_error"] = round(error, 3)
        result["calibration_busy_ok"] = int(error <= BUSY_LIMIT)
        return result


def _step_curve_figures(speed: SpeedModel, model_path: Path) -> dict[str, Any]:
    """What a step of several tokens (a draft's verification) costs the bench's real model
    in single steps, predicted from the calibration and timed: the predicted curve's largest
    miss (``calibration_step_cost_error``)."""
    from localchat.backends.llama.tools import step_times

    predicted = speed.step_costs(token_work(read_gguf(model_path)))
    seconds = step_times(model_path, speed.threads, STEP_SIZES)
    timed = {n: s / seconds[0] for n, s in zip(STEP_SIZES, seconds, strict=True)}
    if predicted is None:
        return {"calibration_step_costs_timed": _rounded(timed)}
    error = max(abs(predicted[n] - timed[n]) / timed[n] for n in STEP_SIZES)
    return {
        "calibration_step_costs_predicted": _rounded(predicted),
        "calibration_step_costs_timed": _rounded(timed),
        "calibration_step_cost_error": round(error, 3),
    }


def _rounded(curve: dict[int, float]) -> dict[str, float]:
    return {str(n): round(cost, 2) for n, cost in curve.items()}


def _settled(models: Path, rounds: int | None = None) -> SpeedModel | str:
    """The calibration, or why it did not settle."""
    try:
        return calibrate(models, machine_name(), rounds=rounds)
    except CalibrationUnsettled as exc:
        return str(exc)
