"""Measure this machine's speed per weight type, once, and keep it (``hw --calibrate``).

Generated models of one shape at several quant types (made once by the demo factory and
cached) are each run for a short prompt and a few tokens through llama.cpp; a tiny model
gives the fixed cost of a token. Each file's time, less what the types already solved
explain, gives the cost per byte of the one type it adds (files are taken in an order where
each adds one). The result is saved with the name of the machine it was measured on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil

from localchat.cpu import physical_cores
from localchat.gguf_info import read_gguf
from localchat.paths import AppPaths
from localchat.speed import SpeedModel, load_speed_model, machine_name

CALIBRATION_SHAPE = "calib"
# Each adds one weight type to those before it (Q2_K files mix Q2_K with Q3_K: one unknown).
CALIBRATION_QUANTS = ("F16", "Q8_0", "Q6_K", "Q4_K_M", "Q2_K", "Q4_0", "Q5_0")
TIED_TYPES = {"Q3_K": "Q2_K"}  # solved together: llama.cpp's Q2_K files always mix the two
MINOR_SHARE = 0.05  # a type under this share of a file's bytes is not solved from that file
PROMPT_TOKENS = 128
BUSY_PERCENT = 50.0  # other work on the CPU while measuring: the figures would read low
GEN_TOKENS = 33
ROUNDS = 2

Progress = Callable[[str], None] | None


def _measure(path: Path, threads: int, rounds: int) -> tuple[float, float]:
    """(seconds per generated token, seconds per prompt token), the best of a few rounds."""
    from localchat.engine import bare_generation_benchmark

    gen = prompt = float("inf")
    for _ in range(rounds):
        result = bare_generation_benchmark(path, 512, PROMPT_TOKENS, GEN_TOKENS, threads)
        gen = min(gen, 1.0 / result["bare_gen_tps"])
        prompt = min(prompt, 1.0 / result["bare_prompt_tps"])
    return gen, prompt


def solve_costs(files: list[tuple[dict[str, int], float]], overhead_s: float) -> dict[str, float]:
    """Seconds per byte of each weight type from (bytes by type, seconds per token) of files,
    each adding one unknown type (or a tied pair) to those already solved."""
    costs: dict[str, float] = {}
    pending = list(files)

    def unknown_of(by_type: dict[str, int]) -> dict[str, int]:
        total = sum(by_type.values())
        return {t: n for t, n in by_type.items() if t not in costs and n >= MINOR_SHARE * total}

    while pending:
        solvable = [
            f for f in pending if len({TIED_TYPES.get(t, t) for t in unknown_of(f[0])}) <= 1
        ]
        if not solvable:
            raise ValueError("calibration files do not add one weight type at a time")
        by_type, seconds = solvable[0]
        pending.remove(solvable[0])
        unknown = unknown_of(by_type)
        explained = sum(n * costs.get(t, 0.0) for t, n in by_type.items() if t not in unknown)
        if unknown:
            left = seconds - overhead_s - explained
            if left <= 0:  # a noisy round (a busy machine): never a free type, so no overhead
                left = seconds * sum(unknown.values()) / max(1, sum(by_type.values()))
            cost = left / sum(unknown.values())
            for weight_type in (*unknown, *(TIED_TYPES.get(t, t) for t in unknown)):
                costs[weight_type] = cost
    return costs


def calibrate(
    models_dir: Path,
    machine: str,
    progress: Progress = None,
    quants: tuple[str, ...] | None = None,
    rounds: int | None = None,
) -> SpeedModel:
    """Measure, fit and return this machine's speed model (saving is the caller's)."""
    quants = quants or CALIBRATION_QUANTS
    rounds = rounds or ROUNDS
    from localchat.demo import ensure_demo_model

    threads = physical_cores()
    say = progress or (lambda _line: None)
    busy = psutil.cpu_percent(interval=0.3)
    if busy > BUSY_PERCENT:
        say(
            f"the machine is busy ({busy:.0f}% CPU): speeds measured now read low;"
            " `localchat hw --calibrate` measures again when it is idle"
        )
    say("measuring this machine's speed (once; `localchat hw --calibrate` measures again)")
    tiny = ensure_demo_model(models_dir, "tiny", "F16")
    gen_overhead, prompt_overhead = _measure(tiny, threads, rounds)
    gen_files: list[tuple[dict[str, int], float]] = []
    prompt_files: list[tuple[dict[str, int], float]] = []
    measured: dict[str, dict[str, float]] = {}
    for quant in quants:
        say(f"speed calibration: {quant} weights")
        path = ensure_demo_model(models_dir, CALIBRATION_SHAPE, quant)
        by_type = read_gguf(path).bytes_read_per_token()
        gen_s, prompt_s = _measure(path, threads, rounds)
        gen_files.append((by_type, gen_s))
        prompt_files.append((by_type, prompt_s))
        measured[quant] = {"gen_tps": round(1 / gen_s, 2), "prompt_tps": round(1 / prompt_s, 2)}
    return SpeedModel(
        solve_costs(gen_files, gen_overhead),
        gen_overhead,
        solve_costs(prompt_files, prompt_overhead),
        prompt_overhead,
        machine,
        threads,
        measured,
    )


def speed_model(paths: AppPaths, progress: Progress = None, again: bool = False) -> SpeedModel:
    """This machine's calibration: the saved one, else (or ``again``) measured now and saved."""
    if not again:
        saved = load_speed_model(paths.speed_calibration)
        if saved is not None:
            return saved
    model = calibrate(paths.demo_models_dir, machine_name(), progress)
    model.save(paths.speed_calibration)
    return model
