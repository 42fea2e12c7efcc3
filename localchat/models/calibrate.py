"""Measure this machine's speed per weight type, once, and keep it (``hw --calibrate``).

Generated models of one shape, each with every matrix of one weight type (random blocks:
speed does not depend on the values, so they are written in a blink, no quantizer, each into
one scratch file just before it is read), are run for a short prompt and a few tokens through
llama.cpp; a tiny model gives the fixed cost of a token. Each file's time, less that fixed
cost, over its bytes gives its type's cost per byte. The result is saved with the name of
the machine it was measured on.

Another program on the cores must not poison the figures for good, so the types are
measured in rounds, each round in a new order (contention then slows a different type each
time), and each type keeps its best reading. A reading is thrown away when llama.cpp's threads
got less than their share of the CPU (the process's CPU time against the wall clock), or when
other programs kept more than a sliver of the machine's CPUs busy (the system's CPU time
less ours: it shows contention on machines with more cores than threads); a whole round is,
when its reference type, read first, was so read or drifts from its best. Each type's figure is its
fastest reading that another reading confirms (within ``AGREE``); the figures are kept only
when every type has one, otherwise nothing is saved and plans go by memory until a later try.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from localchat.cpu import physical_cores
from localchat.errors import LocalchatError, WorldError
from localchat.gguf.estimate import ModelDims
from localchat.gguf.info import GGUFInfo
from localchat.models.attention_cost import attention_price
from localchat.models.speed import (
    STEP_SIZES,
    SpeedModel,
    attention_work,
    load_speed_model,
    machine_name,
    token_work,
)
from localchat.paths import AppPaths
from localchat.progress import Countdown, StepCallback, StepProgress

# One file per weight type the planner prices (llama.cpp's quant mixes are made of these).
CALIBRATION_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q4_0", "Q5_0")
OVERHEAD = "tiny"  # the tiny model's reading: the fixed cost of a token
REFERENCE = "Q4_0"  # read first in every round: a drift there marks the round
MINOR_SHARE = 0.05  # a type under this share of a file's bytes is not solved from that file
PROMPT_TOKENS = 64
GEN_TOKENS = 25  # 24 timed steps of ~100 MB files: 16 read too noisy to agree at times
# Files past a big cache take fewer (``reading_tokens``): each of their steps lasts longer
# (12 steps of 192 MB files as long as 24 of 100 MB ones). A prompt above the largest step.
MIN_PROMPT_TOKENS, MIN_GEN_TOKENS = 16, 8
MIN_CPU_SHARE = 0.8  # of threads x wall time: below it another program had the cores
MAX_OTHERS_SHARE = 0.15  # of all CPUs' time, used by other programs while a file was read
DRIFT = 0.2  # a round whose reference reads this much slower than its best is thrown away
# A reading confirmed by another this close to it: settled. (Within 20% an idle calibration
# here settled no sooner in the bench's runs, and a fast Q8_0 reading it let through
# predicted the 0.5b Q8_0 at 55 tok/s where its turns gave 44.)
AGREE = 0.15
# Prompt readings (a batch of up to 64 tokens, tens of milliseconds) swing more between runs
# of an idle machine (a Q4_K file read 690-866 tok/s); they price prefill only, and
# contention shows in the generation readings and the CPU shares.
PROMPT_AGREE = 0.25
MIN_ROUNDS = 2
MAX_ROUNDS = 5
MAKE_COST = 0.5  # making a test model, in readings (for the progress bar)
# Each step size's best of two per reading (so of four over the two rounds): with one
# timing a reading a 2-core EPYC's calibration predicted its model's 5- and 9-token steps
# 28% dear, where the same kind of machine predicted them within 7-17% another time. (Three
# cost the first calibration 3 s there.)
STEP_REPEATS = 2
ATTENTION_READINGS = 4  # timing attention (attention_cost.py), in readings
BUDGET_S = 40.0  # readings past this (a machine kept busy) end the calibration unsettled
TITLE = "measuring this machine's speed"


class CalibrationSkipped(LocalchatError):
    """The user skipped calibration: plans go by memory until it is measured."""


class CalibrationUnsettled(WorldError):
    """The readings never agreed (a busy machine): nothing was saved."""


@dataclass(frozen=True)
class Reading:
    """One measured file: seconds per generated and per prompt token, and the share of the
    CPU its threads got while it ran."""

    name: str  # a weight type, or OVERHEAD
    gen_s: float
    prompt_s: float
    cpu_share: float
    others_share: float = 0.0  # what other programs used of all CPUs meanwhile
    step_s: tuple[float, ...] = ()  # steps of ``STEP_SIZES`` tokens (a draft's verification)


def round_order(names: list[str], round_index: int) -> list[str]:
    """The reference first, then the others rotated by the round: contention that comes and
    goes slows a different type in each round, and a best-of keeps the clean reading."""
    rest = [n for n in names if n != REFERENCE]
    shift = round_index % max(1, len(rest))
    order = rest[shift:] + rest[:shift]
    return [REFERENCE, *order] if REFERENCE in names else order


def clean_rounds(rounds: list[list[Reading]]) -> list[list[Reading]]:
    """The readings worth keeping, by round: those that had their CPU share, in the rounds
    whose reference had its share and read within ``DRIFT`` of the best clean reference (its
    fastest confirmed reading). A contended reading costs only itself: a round kept its other
    readings only if none was contended, and a first calibration here that met a few seconds
    of contention in each round read five rounds and settled none."""
    usable = [r for r in rounds if r and all(_fair(x) for x in r if x.name == REFERENCE)]
    references = [x.gen_s for r in usable for x in r if x.name == REFERENCE]
    if references:
        best = confirmed(references, AGREE) or min(references)  # a lone fast one sets no bar
        bar = best * (1 + DRIFT)
        usable = [r for r in usable if all(x.gen_s <= bar for x in r if x.name == REFERENCE)]
    return [[x for x in r if _fair(x)] for r in usable]


def settle(rounds: list[list[Reading]], names: list[str]) -> dict[str, Reading] | None:
    """Each file's fastest confirmed reading (``confirmed``), once every file has one
    (generation within ``AGREE``, prompt within ``PROMPT_AGREE``; the tiny model's
    milliseconds need only be clean: its fastest); None while one has not."""
    settled = _settled_readings(rounds, names)
    return settled if len(settled) == len(names) else None


def unsettled(rounds: list[list[Reading]], names: list[str]) -> list[str]:
    """The files without a settled reading yet: what a further round needs to read."""
    settled = _settled_readings(rounds, names)
    return [name for name in names if name not in settled]


def _settled_readings(rounds: list[list[Reading]], names: list[str]) -> dict[str, Reading]:
    kept = clean_rounds(rounds)
    best = best_readings(kept, names)
    settled: dict[str, Reading] = {}
    for name in names:
        if name not in best:
            continue
        if name == OVERHEAD:
            settled[name] = best[name]
            continue
        readings = [x for r in kept for x in r if x.name == name]
        gen = confirmed([x.gen_s for x in readings], AGREE)
        prompt = confirmed([x.prompt_s for x in readings], PROMPT_AGREE)
        if gen is None or prompt is None:
            continue
        share = next(x.cpu_share for x in readings if x.gen_s == gen)
        settled[name] = Reading(name, gen, prompt, share, step_s=_fastest_steps(readings))
    return settled


def _fastest_steps(readings: list[Reading]) -> tuple[float, ...]:
    """Each step size's fastest timing over ``readings`` (every one of them clean)."""
    timed = [x.step_s for x in readings if x.step_s]
    return tuple(min(sizes) for sizes in zip(*timed, strict=True)) if timed else ()


def confirmed(seconds: list[float], tolerance: float) -> float | None:
    """The fastest reading another one confirms (the next slower within ``tolerance``):
    a lone fast reading (a moment of boost, a lucky schedule) cannot be repeated, so it does
    not keep the rest from settling; None while no two agree."""
    ordered = sorted(seconds)
    for fast, next_one in itertools.pairwise(ordered):
        if next_one <= fast * (1 + tolerance):
            return fast
    return None


def best_readings(rounds: list[list[Reading]], names: list[str]) -> dict[str, Reading]:
    """Each file's fastest generation and prompt reading over ``rounds``."""
    best: dict[str, Reading] = {}
    for name in names:
        readings = [x for r in rounds for x in r if x.name == name]
        if readings:
            gen = min(readings, key=lambda x: x.gen_s)
            prompt_s = min(x.prompt_s for x in readings)
            steps = _fastest_steps(readings)
            best[name] = Reading(name, gen.gen_s, prompt_s, gen.cpu_share, step_s=steps)
    return best


def _two_agree(readings: list[Reading]) -> bool:
    return (
        confirmed([x.gen_s for x in readings], AGREE) is not None
        and confirmed([x.prompt_s for x in readings], PROMPT_AGREE) is not None
    )


def solve_costs(files: list[tuple[dict[str, int], float]], overhead_s: float) -> dict[str, float]:
    """Seconds per byte of each weight type from (bytes by type, seconds per token) of files,
    each adding one unknown type to those already solved."""
    costs: dict[str, float] = {}
    pending = list(files)

    def unknown_of(by_type: dict[str, int]) -> dict[str, int]:
        total = sum(by_type.values())
        return {t: n for t, n in by_type.items() if t not in costs and n >= MINOR_SHARE * total}

    while pending:
        solvable = [f for f in pending if len(unknown_of(f[0])) <= 1]
        if not solvable:
            raise ValueError("calibration files do not add one weight type at a time")
        by_type, seconds = solvable[0]
        pending.remove(solvable[0])
        unknown = unknown_of(by_type)
        explained = sum(n * costs.get(t, 0.0) for t, n in by_type.items() if t not in unknown)
        if unknown:
            left = seconds - overhead_s - explained
            if left <= 0:  # a noisy round: never a free type, so no overhead
                left = seconds * sum(unknown.values()) / max(1, sum(by_type.values()))
            cost = left / sum(unknown.values())
            for weight_type in unknown:
                costs[weight_type] = cost
    return costs


def _fair(reading: Reading) -> bool:
    """Read without contention: llama.cpp's threads had the CPU and others had little of it.
    The tiny model's reading lasts milliseconds, too short to load the threads or for the
    system's CPU counters (10 ms ticks) to say anything: it is only ever taken at its best."""
    if reading.name == OVERHEAD:
        return True
    return reading.cpu_share >= MIN_CPU_SHARE and reading.others_share <= MAX_OTHERS_SHARE


def _busy_cpu_s() -> float:
    """CPU seconds every program on the machine has used (all CPUs)."""
    times = psutil.cpu_times()
    return float(sum(times)) - times.idle - getattr(times, "iowait", 0.0)


def reading_tokens(name: str = REFERENCE) -> tuple[int, int]:
    """(prompt, generated) tokens a reading of ``name`` takes: fewer where the files are
    larger than ``CALIBRATION_MIN_BYTES`` (a big cache), so that a reading lasts about as
    long (the tiny model's, milliseconds long, always takes the full count)."""
    from localchat.models.timing_models import CALIBRATION_MIN_BYTES, calibration_min_bytes

    share = 1.0 if name == OVERHEAD else CALIBRATION_MIN_BYTES / calibration_min_bytes()
    prompt = max(MIN_PROMPT_TOKENS, round(PROMPT_TOKENS * share))
    return prompt, max(MIN_GEN_TOKENS, round(GEN_TOKENS * share))


def prompt_token_s(batch_s: float, tokens: int, step_s: float) -> float:
    """What a prompt token costs, from a batch of ``tokens`` that took ``batch_s``: a batch
    reads the weights once, as a single step (``step_s``) does, and each further token adds
    its compute. That addition is what a long prompt's token costs: a batch of 21 tokens
    past a big cache spent a sixth of its time in that one read, and priced as its mean it
    predicted the plan's 448-token prompts 30-43% too slow."""
    return max(batch_s - step_s, batch_s / 2) / max(1, tokens - 1)


def read_speed(path: Path, name: str, threads: int) -> Reading:
    """One timed reading of a file, as the calibration takes it (the plan bench reads the
    reference the same way, to tell the machine's speed now from the calibration's)."""
    from localchat.backends.llama.tools import bare_generation_benchmark

    prompt_tokens, gen_tokens = reading_tokens(name)
    wall, busy, ours = time.monotonic(), _busy_cpu_s(), time.process_time()
    result = bare_generation_benchmark(
        path, 256, prompt_tokens, gen_tokens, threads, STEP_SIZES, STEP_REPEATS
    )
    wall, busy = time.monotonic() - wall, _busy_cpu_s() - busy
    others = max(0.0, busy - (time.process_time() - ours))
    gen_s = 1.0 / result["bare_gen_tps"]
    return Reading(
        name,
        gen_s,
        prompt_token_s(prompt_tokens / result["bare_prompt_tps"], prompt_tokens, gen_s),
        result["cpu_share"],
        others / max(1e-9, wall * (psutil.cpu_count() or 1)),
        tuple(result["step_s"]),
    )


@dataclass
class _Bar:
    """The calibration's progress, in readings (making a test model counts ``MAKE_COST``):
    what is done, shown with its time left; the bar never runs back when a round is added,
    and a skip asked for is raised at the next report."""

    countdown: Countdown
    progress: StepCallback | None
    skip: threading.Event | None
    step: tuple[int, int]
    done: float = 0.0
    shown: float = 0.0

    def report(self, detail: str) -> None:
        if self.skip is not None and self.skip.is_set():
            raise CalibrationSkipped("speed calibration skipped: plans go by memory for now")
        self.shown = max(self.shown, self.countdown.fraction(self.done))
        if self.progress is not None:
            self.progress(
                StepProgress(
                    TITLE,
                    self.shown,
                    detail,
                    self.countdown.eta_s(self.done),
                    *self.step,
                    skippable=True,
                )
            )


def calibrate(
    models_dir: Path,
    machine: str,
    progress: StepCallback | None = None,
    types: tuple[str, ...] | None = None,
    rounds: int | None = None,
    skip: threading.Event | None = None,
    step: tuple[int, int] = (1, 1),
    strict: bool = True,
) -> SpeedModel:
    """Measure, fit and return this machine's speed model (saving is the caller's).

    ``rounds`` caps the rounds (at least ``MIN_ROUNDS`` are read); ``skip`` set stops at the
    next file with :class:`CalibrationSkipped`; readings that never agree raise
    :class:`CalibrationUnsettled` (``strict=False``: the best readings are fitted anyway, for
    tests that need real figures on a machine they keep busy). ``step`` is (this step, of
    how many) for the progress."""
    from localchat.backends.llama.runtime import prepare
    from localchat.models.demo import demo_model_path, ensure_demo_model
    from localchat.models.timing_models import SpeedScratch

    types = types or CALIBRATION_TYPES
    max_rounds = max(MIN_ROUNDS, rounds or MAX_ROUNDS)
    threads = physical_cores()
    names = [OVERHEAD, *types]
    tiny = demo_model_path(models_dir, "tiny", "F16")
    # Making the tiny model, or the scratch file's first model (fresh memory: 1.5 s where a
    # rewrite takes 0.08), costs about half a reading; the bar counts both in those units.
    countdown = Countdown(
        MAKE_COST * (1 + (not tiny.exists())) + MIN_ROUNDS * len(names) + ATTENTION_READINGS
    )
    bar = _Bar(countdown, progress, skip, step)
    prepare()  # llama.cpp's one-time set-up (a child process on AMX CPUs) before any reading
    if not tiny.exists():
        bar.report(f"making the {OVERHEAD} test model")
        ensure_demo_model(models_dir, "tiny", "F16")
        bar.done += MAKE_COST
    with SpeedScratch(models_dir) as scratch:
        first = next(n for n in round_order(names, 0) if n != OVERHEAD)
        bar.report(f"making the {first} test model")
        scratch.holding(first)
        bar.done += MAKE_COST
        rounds_read = _Rounds(names, bar, threads, strict)
        best = rounds_read.read(
            max_rounds, lambda name: tiny if name == OVERHEAD else scratch.holding(name)
        )
        infos = {t: scratch.info(t) for t in types}  # each read: its header is known
    bar.report("attention, timed at a short and a long context")
    attention = attention_price(models_dir, threads)
    bar.done = countdown.total
    bar.report("done")
    return _fit(best, infos, machine, threads, attention)


@dataclass
class _Rounds:
    """The rounds of readings, each file once a round in a new order, until every file's
    reading is settled (or the rounds or the time budget run out)."""

    names: list[str]
    bar: _Bar
    threads: int
    strict: bool
    taken: list[list[Reading]] = field(default_factory=list)

    def read(self, max_rounds: int, path_of: Callable[[str], Path]) -> dict[str, Reading]:
        """The settled readings by name (``strict=False``: the best, settled or not)."""
        best: dict[str, Reading] | None = None
        started = time.monotonic()
        for index in range(max_rounds):
            if index >= MIN_ROUNDS and time.monotonic() - started > BUDGET_S:
                break
            self.taken.append(self._round(index, started, path_of))
            best = settle(self.taken, self.names) if index + 1 >= MIN_ROUNDS else None
            if best is not None:
                break
            if index + 1 >= MIN_ROUNDS:
                more = len(unsettled(self.taken, self.names)) + 1
            else:
                more = len(self.names)
            countdown = self.bar.countdown
            countdown.total = max(countdown.total, self.bar.done + more)  # one more round
        if best is None and not self.strict:
            best = best_readings(self.taken, self.names)
        if best is None:
            raise CalibrationUnsettled(
                f"this machine's speed could not be measured ({_why_unsettled(self.taken)}):"
                " plans go by memory for now; `localchat hw --calibrate` measures again"
            )
        return best

    def _round(self, index: int, started: float, path_of: Callable[[str], Path]) -> list[Reading]:
        """One round's readings: after the first rounds, only the files not yet settled
        (and the reference, which tells a drift)."""
        readings: list[Reading] = []
        order = round_order(self.names, index)
        if index >= MIN_ROUNDS:
            pending = set(unsettled(self.taken, self.names))
            order = [n for n in order if n in pending or n == REFERENCE]
        for name in order:
            if index >= MIN_ROUNDS and time.monotonic() - started > BUDGET_S:
                break  # a machine kept busy: the budget ends a round too
            self.bar.report(f"{name} weights, round {index + 1}")
            reading = read_speed(path_of(name), name, self.threads)
            readings.append(reading)
            self.bar.done += 1
            if self.strict and name == REFERENCE and not _fair(reading):
                break  # the round would be thrown away whole (clean_rounds): next one now
        return readings


def _why_unsettled(rounds: list[list[Reading]]) -> str:
    """Which rule kept the readings from settling, in words: readings of a type that were
    clean yet disagreed, else the contention that left types without two clean readings
    (the rule that threw away most), else drift."""
    readings = [x for r in rounds for x in r if x.name != OVERHEAD]
    kept = clean_rounds(rounds)
    clean: dict[str, list[Reading]] = {x.name: [] for x in readings}
    for reading in (x for r in kept for x in r if x.name != OVERHEAD):
        clean[reading.name].append(reading)
    apart = [n for n in sorted(clean) if len(clean[n]) >= 2 and not _two_agree(clean[n])]
    if apart:
        return f"repeated readings of {', '.join(apart)} differed by more than {100 * AGREE:.0f}%"
    others = max((x.others_share for x in readings), default=0.0)
    share = min((x.cpu_share for x in readings), default=1.0)
    if others > MAX_OTHERS_SHARE:
        return f"other programs kept up to {100 * others:.0f}% of the CPUs busy"
    if share < MIN_CPU_SHARE:
        return f"localchat's threads got as little as {100 * share:.0f}% of the CPU"
    return "its speed drifted from round to round"


def _fit(
    best: dict[str, Reading],
    infos: dict[str, GGUFInfo],
    machine: str,
    threads: int,
    attention: float = 0.0,
) -> SpeedModel:
    overhead = best[OVERHEAD]
    types = tuple(infos)
    gen = [
        (token_work(infos[t]), best[t].gen_s - reading_attention_s(t, infos[t], attention))
        for t in types
    ]
    # A step of several tokens: each type's file's, less the tiny model's (its fixed part).
    steps = {
        t: [
            max(0.0, s - o) / token_work(infos[t])[t]
            for s, o in zip(best[t].step_s, overhead.step_s, strict=True)
        ]
        for t in types
    }
    prompt = [(token_work(infos[t], prompt=True), best[t].prompt_s) for t in types]
    return SpeedModel(
        solve_costs(gen, overhead.gen_s),
        overhead.gen_s,
        solve_costs(prompt, overhead.prompt_s),
        overhead.prompt_s,
        machine,
        threads,
        {
            t: {
                "gen_tps": round(1 / best[t].gen_s, 2),
                "prompt_tps": round(1 / best[t].prompt_s, 2),
            }
            for t in types
        },
        step_s_per_byte=steps,
        step_overhead_s=list(overhead.step_s),
        attention_s_per_byte=attention,
    )


def reading_attention_s(name: str, info: GGUFInfo, price: float) -> float:
    """What a generated token of ``name``'s reading spent attending (its mean fill: the
    prompt and half the generated tokens) at ``price`` a byte: taken off the reading before
    its weights are priced (few layers: 0.4-3% of a reading, but the same rule as a model's)."""
    prompt_tokens, gen_tokens = reading_tokens(name)
    return price * attention_work(ModelDims.from_gguf(info), prompt_tokens + gen_tokens // 2)


def speed_model(
    paths: AppPaths,
    progress: StepCallback | None = None,
    again: bool = False,
    skip: threading.Event | None = None,
    step: tuple[int, int] = (1, 1),
) -> SpeedModel:
    """This machine's calibration: the saved one, else (or ``again``) measured now and saved.
    Raises :class:`CalibrationUnsettled` (nothing saved) or :class:`CalibrationSkipped`."""
    from localchat.models.timing_models import remove_left_speed_models

    # What earlier versions kept (1-2 GB of disk) and killed calibrations left, whether or
    # not this measures anew; best effort: a file it cannot delete stays.
    remove_left_speed_models(paths.demo_models_dir)
    if not again:
        saved = load_speed_model(paths.speed_calibration)
        if saved is not None:
            return saved
    model = calibrate(paths.demo_models_dir, machine_name(), progress, skip=skip, step=step)
    keep_calibration(paths, model)
    return model


def keep_calibration(paths: AppPaths, model: SpeedModel) -> None:
    """Save ``model`` as this machine's calibration; turns are counted against it anew."""
    model.save(paths.speed_calibration)
    paths.turn_speeds.unlink(missing_ok=True)


def speed_model_or_none(
    paths: AppPaths,
    say: Callable[[str], object],
    progress: StepCallback | None = None,
    skip: threading.Event | None = None,
    step: tuple[int, int] = (1, 1),
) -> SpeedModel | None:
    """The calibration, or None (plans by memory) with the reason said in one line."""
    try:
        return speed_model(paths, progress, skip=skip, step=step)
    except LocalchatError as exc:  # unsettled, skipped, a test model llama.cpp refused
        say(str(exc))
        return None
    except ValueError as exc:  # files that do not solve (a llama.cpp that mixes types anew)
        say(f"this machine's speed could not be measured ({exc}): plans go by memory for now")
        return None
    except OSError as exc:  # its test models could not be written (a full disk)
        reason = exc.strerror or str(exc)
        say(
            f"this machine's speed could not be measured (its test models could not be"
            f" written in {paths.demo_models_dir}: {reason}): plans go by memory for now;"
            " `localchat hw --calibrate` measures again"
        )
        return None
