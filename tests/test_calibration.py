"""A calibration a busy machine cannot poison: interleaved rounds, each type's best, readings
thrown away when llama.cpp's threads did not get the CPU, rounds when the reference did not
or drifted, nothing saved unless two clean readings agree; Esc skips it; the progress counts
up with time left.
The rules are checked on readings; the measurement itself on real llama.cpp runs."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from localchat.cli.main import main
from localchat.models import calibrate as cal
from localchat.models.calibrate import (
    OVERHEAD,
    REFERENCE,
    CalibrationSkipped,
    Reading,
    clean_rounds,
    round_order,
    settle,
    speed_model_or_none,
)
from localchat.models.speed import machine_name
from localchat.paths import app_paths
from localchat.progress import StepProgress

NAMES = [OVERHEAD, "F16", "Q8_0", "Q4_K_M", "Q2_K", REFERENCE]
# Seconds per generated token on an idle machine (what contention must not reorder).
IDLE = {OVERHEAD: 0.0002, "F16": 0.0150, "Q8_0": 0.0090, "Q4_K_M": 0.0080, "Q2_K": 0.0060,
        REFERENCE: 0.0070}  # fmt: skip


@pytest.fixture(autouse=True)
def _files_of_a_small_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the rules on files of the floor's size (100 MB), whatever cache this
    machine has (test_speed.py checks the sizing)."""
    from localchat.models import timing_models

    monkeypatch.setattr(timing_models, "last_level_cache_bytes", lambda: 0)


def _reading(name: str, slow: float = 1.0, share: float = 0.95) -> Reading:
    return Reading(name, IDLE[name] * slow, IDLE[name] * slow / 8, share)


def _round(slow: dict[str, float] | None = None, share: float = 0.95) -> list[Reading]:
    slow = slow or {}
    return [_reading(n, slow.get(n, 1.0), share if n in slow else 0.95) for n in NAMES]


def test_each_round_reads_the_reference_first_and_the_rest_in_a_new_order() -> None:
    orders = [round_order(NAMES, i) for i in range(3)]
    assert all(order[0] == REFERENCE and sorted(order) == sorted(NAMES) for order in orders)
    assert orders[0] != orders[1] != orders[2]


def test_a_reading_where_another_program_had_the_cpu_is_thrown_away() -> None:
    shared = _round({"Q4_K_M": 2.0}, share=0.5)
    rest = [x for x in shared if x.name != "Q4_K_M"]
    assert clean_rounds([_round(), shared, _round()]) == [_round(), rest, _round()]
    # Without a clean reference a round cannot tell a slow spell: it goes whole.
    unsure = _round({REFERENCE: 2.0, "F16": 1.0}, share=0.5)
    assert clean_rounds([_round(), unsure]) == [_round()]
    # The tiny model's token is too short to load the threads: its share is not judged.
    assert clean_rounds([_round({OVERHEAD: 1.0}, share=0.3)]) != []
    # Nor do the system's 10 ms CPU ticks over its milliseconds.
    tiny = [*_round()[1:], Reading(OVERHEAD, IDLE[OVERHEAD], IDLE[OVERHEAD] / 8, 0.7, 0.3)]
    assert clean_rounds([tiny]) == [tiny]


def test_a_round_whose_reference_drifted_is_thrown_away() -> None:
    drifted = _round({REFERENCE: 1.4, "F16": 1.4})  # full share, yet everything slower
    assert clean_rounds([_round(), drifted]) == [_round()]


def test_it_settles_only_on_two_clean_readings_that_agree() -> None:
    assert settle([_round()], NAMES) is None  # one round proves nothing
    assert settle([_round(), _round({"Q2_K": 1.3})], NAMES) is None  # they disagree
    best = settle([_round(), _round({"Q2_K": 1.1}), _round({"Q2_K": 1.3})], NAMES)
    assert best is not None and best["Q2_K"].gen_s == pytest.approx(IDLE["Q2_K"])
    # A lone fast reading no other confirms does not keep the type from settling: the
    # fastest confirmed one is its figure.
    lucky = [_round({"Q2_K": 0.7}), _round({"Q2_K": 1.0}), _round({"Q2_K": 1.05})]
    best = settle(lucky, NAMES)
    assert best is not None and best["Q2_K"].gen_s == pytest.approx(IDLE["Q2_K"])


def test_contention_that_comes_and_goes_cannot_reorder_the_types() -> None:
    rng = random.Random(7)
    rounds = []
    for index in range(6):  # two hogs on and off: every other round, a random half read slow
        hit = {n: rng.uniform(2, 3) for n in NAMES if index % 2 == 0 and rng.random() < 0.5}
        rounds.append(_round(hit, share=0.5))
    best = settle(rounds, NAMES)
    assert best is not None  # settled on the clean rounds, in the idle order
    assert all(best[n].gen_s == pytest.approx(IDLE[n]) for n in NAMES)
    # Contention everywhere, always: never settles (nothing would be saved).
    busy = [_round(dict.fromkeys(NAMES, 2.5), share=0.5) for _ in range(5)]
    assert settle(busy, NAMES) is None


def test_other_programs_busy_on_spare_cores_spoil_a_round_too() -> None:
    # Eight cores, two hogs: llama.cpp's threads still get 85% of theirs, yet run slow.
    slow = [Reading(n, IDLE[n] * 2, IDLE[n] * 2 / 8, 0.85, others_share=0.25) for n in NAMES]
    assert clean_rounds([slow, slow]) == []
    assert settle([slow, slow, slow], NAMES) is None


def test_a_calibration_that_never_settles_is_not_saved_and_plans_go_by_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # No reading can have this share of the CPU: every round counts as contended.
    monkeypatch.setattr(cal, "MIN_CPU_SHARE", 1.5)
    monkeypatch.setattr(cal, "CALIBRATION_TYPES", ("Q8_0",))
    assert main(["hw", "--json"]) == 0
    captured = capsys.readouterr()
    assert "speed could not be measured" in captured.err and "hw --calibrate" in captured.err
    assert not app_paths().speed_calibration.exists()
    plans = json.loads(captured.out)["plans"]
    assert plans and all(p["predicted_gen_tps"] is None for p in plans)


def test_esc_skips_the_calibration_and_plans_go_by_memory() -> None:
    skip = threading.Event()
    skip.set()
    said: list[str] = []
    assert speed_model_or_none(app_paths(), said.append, skip=skip) is None
    assert said and "skipped" in said[0]
    assert not app_paths().speed_calibration.exists()
    with pytest.raises(CalibrationSkipped):
        cal.calibrate(app_paths().demo_models_dir, machine_name(), skip=skip)


@pytest.mark.parametrize("full_at", ["the tiny model", "a speed model"])
def test_a_full_disk_leaves_no_half_file_and_plans_go_by_memory(
    monkeypatch: pytest.MonkeyPatch, full_at: str
) -> None:
    import errno
    from pathlib import Path

    from localchat.models import demo

    if full_at == "a speed model":  # the tiny model made: the scratch file fills the disk
        demo.ensure_demo_model(app_paths().demo_models_dir, "tiny", "F16")

    def full_disk(*args: object, **_kwargs: object) -> None:
        out = args[2]  # (shape, seed, out, ...): the file half written, then the disk full
        assert isinstance(out, Path)
        out.write_bytes(b"GGUF" + bytes(1000))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(demo, "_write_model", full_disk)
    monkeypatch.setattr(cal, "CALIBRATION_TYPES", ("Q8_0",))
    said: list[str] = []
    assert speed_model_or_none(app_paths(), said.append) is None
    assert len(said) == 1 and "No space left on device" in said[0]
    assert str(app_paths().demo_models_dir) in said[0] and "plans go by memory" in said[0]
    made = [p.name for p in app_paths().demo_models_dir.glob("*")]
    assert made == (["demo-tiny-F16-s0.gguf"] if full_at == "a speed model" else [])
    assert not app_paths().speed_calibration.exists()


def test_esc_midway_leaves_no_test_model_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    skip = threading.Event()
    real_read = cal.read_speed

    def read_then_esc(path: object, name: str, threads: int) -> Reading:
        skip.set()  # pressed while the scratch file holds a type's model
        assert isinstance(path, Path) and path.exists()
        return real_read(path, name, threads)

    monkeypatch.setattr(cal, "read_speed", read_then_esc)
    with pytest.raises(CalibrationSkipped):
        cal.calibrate(app_paths().demo_models_dir, machine_name(), types=("Q8_0",), skip=skip)
    assert [p.name for p in app_paths().demo_models_dir.iterdir()] == ["demo-tiny-F16-s0.gguf"]


def test_the_progress_counts_up_with_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[StepProgress] = []
    speed = cal.calibrate(
        app_paths().demo_models_dir, machine_name(), steps.append, ("Q8_0",), step=(2, 3),
        strict=False,
    )  # fmt: skip
    assert speed.gen_s_per_byte["Q8_0"] > 0
    fractions = [s.fraction for s in steps]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert all(s.step == 2 and s.steps == 3 and s.skippable for s in steps)
    assert any(s.eta_s is not None for s in steps[1:])
    assert any("making the tiny test model" in s.detail for s in steps)
    assert any("Q8_0 weights, round 2" in s.detail for s in steps)
    # Each type's file was written into one scratch file, gone now with the calibration;
    # the tiny model and the one attention is timed on stay (40 MB together).
    assert sorted(p.name for p in app_paths().demo_models_dir.iterdir()) == [
        "demo-tiny-F16-s0.gguf",
        "timing-attention-768x12on2.gguf",
    ]
    assert any("attention" in s.detail for s in steps)
    assert steps[-1].line().startswith("step 2/3 · measuring this machine's speed 100%")


def test_an_unsettled_calibration_names_the_types_whose_readings_disagreed() -> None:
    def round_of(q2_k_s: float) -> list[Reading]:
        return [
            Reading(REFERENCE, 0.010, 0.001, 0.95),
            Reading("Q2_K", q2_k_s, 0.001, 0.95),
            Reading(OVERHEAD, 0.0001, 0.00001, 0.5),
        ]

    rounds = [round_of(0.010), round_of(0.015)]  # clean rounds; Q2_K half again as slow
    assert settle(rounds, [REFERENCE, "Q2_K", OVERHEAD]) is None
    assert cal._why_unsettled(rounds) == "repeated readings of Q2_K differed by more than 15%"


def test_a_contended_reference_ends_its_round_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round is kept only if its reference reading was fair: after an unfair one the rest
    of the round would be read for nothing, so a machine kept busy gives up in a few
    readings."""
    read: list[str] = []

    def contended(_path: object, name: str, _threads: int) -> Reading:
        read.append(name)
        return Reading(name, 0.01, 0.001, 0.3)  # a third of the CPU: another program had it

    monkeypatch.setattr(cal, "read_speed", contended)
    with pytest.raises(cal.CalibrationUnsettled, match="as little as 30% of the CPU"):
        cal.calibrate(
            app_paths().demo_models_dir, machine_name(), types=("Q8_0", REFERENCE), rounds=2
        )
    assert read == [REFERENCE, REFERENCE]  # each round stopped at its first reading


def test_a_contended_reading_costs_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past a fair reference, a contended reading is dropped alone: the round reads on and
    its clean readings count, so only that type is read again (when a whole round went, a
    few seconds of contention in each round kept a first calibration from settling)."""
    read: list[str] = []
    seconds = {REFERENCE: 0.007, "Q8_0": 0.009, "Q2_K": 0.006, OVERHEAD: 0.0002}

    def reading(_path: object, name: str, _threads: int) -> Reading:
        read.append(name)
        contended = name == "Q8_0" and read.count(name) == 1  # the first round's only
        return Reading(name, seconds[name], seconds[name] / 8, 0.3 if contended else 0.95)

    monkeypatch.setattr(cal, "read_speed", reading)
    speed = cal.calibrate(
        app_paths().demo_models_dir, machine_name(), types=("Q8_0", "Q2_K", REFERENCE)
    )
    assert read == [
        *(REFERENCE, OVERHEAD, "Q8_0", "Q2_K"),  # read on past the contended Q8_0
        *(REFERENCE, "Q8_0", "Q2_K", OVERHEAD),
        *(REFERENCE, "Q8_0"),  # only what had not settled: Q8_0's second clean reading
    ]
    assert speed.measured["Q8_0"]["gen_tps"] == pytest.approx(1 / seconds["Q8_0"], rel=0.01)
