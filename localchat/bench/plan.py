"""``bench --only plan``: the planner's predicted tokens/s (from this machine's calibration)
against real turns through the engine, two shapes at five quants.

The models have each tensor in the type llama.cpp's quantizer gives that quant, their blocks
random (``models/timing_models.py``): the same bytes by type as the quantizer's files, made in
seconds where quantizing the ten took three minutes. Speed depends little on the values:
``mix_speed_ratio`` reports how little each run, the 0.5b Q4_K_M mix against the quantizer's
file (the bench's main model) in interleaved turns (0.945-0.983 here: the mix a few percent
slower).

The host's speed moves by up to 30% within an hour, and the calibration ran minutes before
(in one run every model read 10-20% under its prediction, the next run's calibration
agreeing with the earlier one). So each pass over the models also reads every calibration
file as the calibration does, and ``speed_prediction_max_error`` compares each model's speed
at the machine's speed of the calibration: measured over ``host_speed``, the median over the
passes of the median file's speed over its calibrated one (the speed model is judged, not
the host's hour). ``speed_prediction_max_error_raw`` is the same without that correction."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import (
    Progress,
    greedy_turn,
    say,
    settled,
    steady_best,
)
from localchat.cpu import physical_cores

if TYPE_CHECKING:
    from localchat.models.planner import Plan
    from localchat.models.timing_models import SpeedScratch

PLAN_MODELS: tuple[tuple[str, str], ...] = tuple(
    (shape, quant)
    for shape in ("0.5b", "1b")
    for quant in ("F16", "Q8_0", "Q6_K", "Q4_K_M", "Q2_K")
)
PLAN_CTX = 2048
PLAN_PROMPT_TOKENS = 448  # with the reply, about the fill predictions are made for
PLAN_GEN_TOKENS = 32  # 31 gaps of 30-110 ms: timer noise is nothing to them
# Rounds sized by noise: two, and a third only when those two disagree by more than
# PLAN_AGREE (the median of three then drops the odd one). Most models settle in two; the
# prompt is read in the first only (``_timed_models``). The rounds go through the ten models
# in turn, a model's next round a pass (~40 s) after its last: a slow spell of the host
# (~10 s) covered both of one model's back-to-back rounds, and they agreed on a speed 25%
# below its usual one.
PLAN_MIN_ROUNDS = 2
PLAN_MAX_ROUNDS = 3
PLAN_AGREE = 0.05
MIX_PAIRS = 4  # interleaved turns of the mix and the quantizer's file: 10 s


def bench_plan(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Predicted tokens/s (the planner's, from this machine's calibration) against what a
    real turn through the engine measures, for each demo shape and quant."""
    from localchat.models.calibrate import speed_model
    from localchat.models.hardware import detect_hardware
    from localchat.models.planner import plan_file
    from localchat.models.timing_models import SpeedScratch, ensure_mix_model
    from localchat.paths import app_paths

    paths = app_paths()
    say(progress, "plan: this machine's calibration (measured now if none is saved)")
    speed = speed_model(paths)
    hardware = detect_hardware()
    rows: dict[str, dict[str, float]] = {}
    files = {
        f"{shape} {quant}": ensure_mix_model(paths.demo_models_dir, shape, quant)
        for shape, quant in PLAN_MODELS
    }
    calibrated = {t: m["gen_tps"] for t, m in speed.measured.items() if m.get("gen_tps")}
    with SpeedScratch(paths.demo_models_dir) as scratch:
        timed, drifts = _timed_models(files, scratch, calibrated, progress)
    host_speed = statistics.median(drifts) if drifts else 1.0
    say(progress, f"plan: the calibration's files read at {host_speed:.2f}x their calibrated speed")
    for name, path in files.items():
        gen, prompt_tps = timed[name]
        plan = plan_file(path, hardware, PLAN_CTX, speed)
        row = rows[name] = _prediction_row(plan, gen, prompt_tps, host_speed)
        say(progress, f"plan: {name}: predicted {row['predicted_gen_tps']:.1f}, measured"
            f" {row['measured_gen_tps']:.1f} ({', '.join(f'{tps:.1f}' for tps in gen)})")  # fmt: skip
    prompt_errors = [
        abs(r["predicted_prompt_tps"] - r["measured_prompt_tps"]) / r["measured_prompt_tps"]
        for r in rows.values()
    ]
    say(progress, "plan: the 0.5b Q4_K_M mix against the quantizer's file")
    mix_speed_ratio = _mix_speed_ratio(paths.demo_models_dir)
    return {
        "mix_speed_ratio": mix_speed_ratio,
        "speed_calibration": speed.machine,
        "speed_predictions": rows,
        "host_speed": round(host_speed, 3),
        "speed_prediction_max_error": max(r["gen_error"] for r in rows.values()),
        "speed_prediction_max_error_raw": max(r["gen_error_raw"] for r in rows.values()),
        "prompt_prediction_max_error": round(max(prompt_errors), 3),
    }


def _prediction_row(
    plan: Plan, gen: list[float], prompt_tps: float, host_speed: float
) -> dict[str, float]:
    """One model's predicted speeds against its measured ones; the generation error both at
    the calibration's host speed and raw."""
    # The steady best round, as the calibration keeps each file's fastest confirmed
    # reading: both say what the machine does when its neighbours leave it alone.
    measured = steady_best(gen, PLAN_AGREE)
    at_calibration = measured / host_speed
    predicted = plan.predicted_gen_tps or 0.0
    return {
        "predicted_gen_tps": round(predicted, 1),
        "measured_gen_tps": round(measured, 1),
        "measured_gen_tps_median": round(statistics.median(gen), 1),
        "measured_at_calibration_speed": round(at_calibration, 1),
        "gen_error": round(abs(predicted - at_calibration) / at_calibration, 3),
        "gen_error_raw": round(abs(predicted - measured) / measured, 3),
        "predicted_prompt_tps": round(plan.predicted_prompt_tps or 0.0, 1),
        "measured_prompt_tps": round(prompt_tps, 1),
        "rounds": len(gen),
    }


def _timed_models(
    files: dict[str, Path], scratch: SpeedScratch, calibrated: dict[str, float], progress: Progress
) -> tuple[dict[str, tuple[list[float], float]], list[float]]:
    """Per model: generation tokens/s of greedy turns, as many as it takes to settle (two,
    or three when two disagree), and the prompt's tokens/s. The rounds are passes over the
    models, each model loaded for its turn. The prompt is read in the first pass only: its
    state is kept in memory, and later turns generate from it restored (the same fill, the
    same positions), which saves a third of this part's time on the 1b models. Each pass
    starts with a reading of every calibration file as the calibration takes it (written
    into ``scratch``): the median of their speeds over ``calibrated`` is that pass's drift
    from the calibration, returned beside. (The reference type alone read 1.58x its
    calibrated speed in a run whose calibration had caught it in a slow spell, where the
    other types read near theirs: a raw 0.21 became 0.79.)"""
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.backends.llama.tools import synthetic_prompt
    from localchat.models.calibrate import read_speed

    gen: dict[str, list[float]] = {name: [] for name in files}
    prompt_tps: dict[str, float] = {}
    states: dict[str, tuple[bytes, list[int]]] = {}
    drifts: list[float] = []
    for index in range(PLAN_MAX_ROUNDS):
        due = [
            name
            for name, speeds in gen.items()
            if len(speeds) < PLAN_MIN_ROUNDS or not settled(speeds, PLAN_AGREE)
        ]
        if not due:
            break
        say(progress, f"plan: round {index + 1} of the models")
        ratios = [
            1.0 / read_speed(scratch.holding(t), t, physical_cores()).gen_s / tps
            for t, tps in calibrated.items()
        ]
        if ratios:
            drifts.append(statistics.median(ratios))
        for name in due:
            path, speeds = files[name], gen[name]
            engine = Engine(path, LoadOptions(n_ctx=PLAN_CTX, n_threads=physical_cores()))
            try:
                prompt = synthetic_prompt(engine.bos_token, engine.n_vocab, PLAN_PROMPT_TOKENS)
                if name in states and engine.cache.load_sequence_state(*states[name]):
                    speeds.append(greedy_turn(engine, prompt, PLAN_GEN_TOKENS, cold=False).gen_tps)
                    continue
                first = greedy_turn(engine, prompt, PLAN_GEN_TOKENS)
                speeds.append(first.gen_tps)
                prompt_tps[name] = first.prompt_tps
                states[name] = (engine.cache.save_sequence_state(), engine.cache.cached_tokens)
            finally:
                engine.close()
    return {name: (gen[name], prompt_tps[name]) for name in files}, drifts


def _mix_speed_ratio(models_dir: Path, pairs: int = MIX_PAIRS) -> float:
    """Generation tokens/s of the 0.5b Q4_K_M mix over the quantizer's own file: both loaded,
    their turns interleaved, the median of ``pairs`` ratios."""
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.backends.llama.tools import synthetic_prompt
    from localchat.models.demo import ensure_demo_model
    from localchat.models.timing_models import ensure_mix_model

    paths = (ensure_mix_model(models_dir, "0.5b", "Q4_K_M"), ensure_demo_model(models_dir, "0.5b"))
    options = LoadOptions(n_ctx=PLAN_CTX, n_threads=physical_cores())
    mix, real = engines = [Engine(path, options) for path in paths]
    try:
        prompt = synthetic_prompt(real.bos_token, real.n_vocab, PLAN_PROMPT_TOKENS)
        for engine in engines:  # each reads the prompt once; the turns generate from it
            greedy_turn(engine, prompt, 1)
        ratios = []
        for _ in range(pairs):
            mix_tps = greedy_turn(mix, prompt, PLAN_GEN_TOKENS, cold=False).gen_tps
            ratios.append(mix_tps / greedy_turn(real, prompt, PLAN_GEN_TOKENS, cold=False).gen_tps)
    finally:
        for engine in engines:
            engine.close()
    return round(statistics.median(ratios), 3)
