"""Real turns correct the calibration: once three of the last five timed turns are in, a
median more than 10% off the prediction updates the figures that priced the file; turns
that did not have the CPU are not counted."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from localchat.cli.main import main
from localchat.gguf.info import read_gguf
from localchat.models.speed import SpeedModel, load_speed_model, machine_name, token_work
from localchat.models.speed_feedback import TurnSpeed, note_turn
from localchat.paths import app_paths

NS = 1e-9
COSTS = {"F16": 0.04 * NS, "Q8_0": 0.05 * NS, "Q4_K": 0.05 * NS, "Q6_K": 0.07 * NS}
BYTES = {"Q4_K": 300_000_000, "Q6_K": 60_000_000}


def _saved(overhead_s: float = 1e-3) -> SpeedModel:
    speed = SpeedModel(COSTS, overhead_s, COSTS, overhead_s / 10, machine_name(), 2)
    speed.save(app_paths().speed_calibration)
    return speed


ATTENTION = 40_000_000  # a token's attention at its fill, as F16 bytes


def _turn(
    gen_tps: float, tokens: int = 64, model: str = "m.gguf", cpu_share: float = 1.0
) -> TurnSpeed:
    return TurnSpeed(model, BYTES, ATTENTION, tokens, gen_tps, 2, cpu_share)


def _note(turn: TurnSpeed) -> str | None:
    return note_turn(app_paths().speed_calibration, app_paths().turn_speeds, turn)


def _predicted() -> float:
    speed = load_speed_model(app_paths().speed_calibration)
    assert speed is not None
    prediction = speed.predict(BYTES, ATTENTION)
    assert prediction is not None
    return prediction.gen_tps


def test_three_turns_that_keep_missing_update_the_figures() -> None:
    _saved()
    predicted = _predicted()
    measured = predicted * 0.5  # the machine runs this file at half the predicted speed
    assert _note(_turn(measured)) is None
    assert _note(_turn(measured * 1.05)) is None
    notice = _note(_turn(measured * 0.95))
    assert notice and "corrected from use" in notice and "\n" not in notice
    assert _predicted() == pytest.approx(measured, rel=0.1)
    assert json.loads(app_paths().turn_speeds.read_text()) == {}  # counted afresh from here


@pytest.mark.parametrize("side", [0.85, 1.15])
def test_a_machine_15_percent_off_on_one_side_is_corrected_within_five_turns(
    side: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two of its first five turns slowed by a neighbour (one read at 40%, one whose threads
    got 60% of the CPU): the median of the rest still finds the machine's speed."""
    steps = {"Q4_K": [0.05 * NS, 0.1 * NS, 0.12 * NS, 0.15 * NS, 0.2 * NS]}
    saved = replace(_saved(), step_s_per_byte=steps, step_overhead_s=[1e-3] * 5)
    saved.save(app_paths().speed_calibration)
    predicted = _predicted()
    turns = [
        _turn(predicted * side),
        _turn(predicted * 0.4),  # a busy moment that still had the CPU share
        _turn(predicted * side * 0.3, cpu_share=0.6),  # not counted
        _turn(predicted * side * 1.02),
        _turn(predicted * side * 0.98),
    ]
    notices = [_note(turn) for turn in turns]
    assert notices[:3] == [None, None, None] and any(notices[3:])
    speed = load_speed_model(app_paths().speed_calibration)
    assert speed is not None
    assert _predicted() == pytest.approx(predicted * side, rel=0.05)
    assert speed.corrections["m.gguf"] == pytest.approx(side, rel=0.05)
    assert "corrected from use (m.gguf x" in speed.describe()
    assert speed.step_s_per_byte == saved.step_s_per_byte  # the curves stay as measured
    assert speed.step_overhead_s == saved.step_overhead_s
    assert main(["hw"]) == 0  # the plans price with it, and say so
    assert "SPEED calibrated on this machine (2 threads), corrected from use (m.gguf x" in (
        capsys.readouterr().out
    )


def test_turns_near_the_prediction_short_or_on_both_sides_change_nothing() -> None:
    speed = _saved()
    predicted = _predicted()
    for gen_tps in (predicted * 0.93, predicted * 1.08, predicted * 0.95, predicted * 1.02):
        assert _note(_turn(gen_tps)) is None  # within 10%
    for gen_tps in (predicted * 0.5, predicted * 2.0, predicted * 1.0):  # both sides
        assert _note(_turn(gen_tps)) is None
    for _ in range(4):  # too short to time
        assert _note(_turn(predicted * 0.2, tokens=8)) is None
    for _ in range(4):  # a busy machine: the threads got half the CPU
        assert _note(_turn(predicted * 0.5, cpu_share=0.5)) is None
    assert load_speed_model(app_paths().speed_calibration) == speed


def test_turns_on_other_threads_than_measured_say_nothing() -> None:
    speed = _saved()
    slow = _turn(_predicted() * 0.3)
    for _ in range(4):
        assert _note(replace(slow, threads=1)) is None
    assert load_speed_model(app_paths().speed_calibration) == speed


def test_a_correction_leaves_alone_the_types_a_file_has_only_a_little_of() -> None:
    _saved()
    with_norms = {**BYTES, "F16": 1_000_000}  # norms priced as F16: under 5% of the file
    predicted = _predicted()
    for _ in range(3):
        notice = _note(TurnSpeed("m.gguf", with_norms, ATTENTION, 64, predicted * 0.5, 2))
    assert notice
    speed = load_speed_model(app_paths().speed_calibration)
    assert speed is not None and speed.gen_s_per_byte["F16"] == COSTS["F16"]
    assert speed.gen_s_per_byte["Q4_K"] > COSTS["Q4_K"]


def test_misses_are_counted_per_model_file() -> None:
    _saved()
    predicted = _predicted()
    assert _note(_turn(predicted * 3, model="a.gguf")) is None
    assert _note(_turn(predicted * 3, model="b.gguf")) is None
    assert _note(_turn(predicted * 3, model="a.gguf")) is None
    assert _note(_turn(predicted * 3, model="a.gguf"))  # a's third


def test_a_local_turn_reports_the_cpu_share_its_threads_had(tiny_model: Path) -> None:
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions

    engine = Engine(tiny_model, LoadOptions(n_ctx=256, n_threads=2))
    try:
        reply = engine.generate(engine.tokenize("count to ten"), Sampling(temperature=0.0), 48)
        for _ in reply:
            pass
    finally:
        engine.close()
    share = reply.stats.gen_cpu_share
    assert share is not None and 0.0 < share < 1.5  # busy-waiting threads read about 1


def test_ask_turns_on_a_real_model_correct_a_calibration_that_is_far_off(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The share rule has its own tests; this one must hold beside a CPU hog too.
    monkeypatch.setattr("localchat.models.speed_feedback.MIN_CPU_SHARE", 0.0)
    # Figures a hundred times too slow for this machine (as a poisoned calibration was).
    read = token_work(read_gguf(tiny_model))
    slow = {t: 1e-6 for t in [*read, "F16"]}
    SpeedModel(slow, 0.05, slow, 0.005, machine_name(), 2).save(app_paths().speed_calibration)
    before = app_paths().speed_calibration.read_text()
    args = ["ask", "count to ten", "--model-path", str(tiny_model), "--temperature", "0"]
    errors = []
    for _ in range(3):
        assert main([*args, "--max-tokens", "48", "--json"]) == 0
        errors.append(capsys.readouterr().err)
    assert "corrected from use" in errors[-1]
    assert not any("corrected" in e for e in errors[:-1])
    assert app_paths().speed_calibration.read_text() != before


def test_a_correction_starts_every_files_count_afresh() -> None:
    """Another file of the same types was measured against the figures a correction changed:
    its misses so far must not correct them a second time."""
    _saved()
    predicted = _predicted()
    for _ in range(2):
        assert _note(_turn(predicted * 0.8, model="b.gguf")) is None
    for _ in range(2):
        assert _note(_turn(predicted * 0.8, model="a.gguf")) is None
    assert _note(_turn(predicted * 0.8, model="a.gguf"))  # a's third: corrected
    assert _note(_turn(_predicted(), model="b.gguf")) is None  # b's third, counted afresh
    assert json.loads(app_paths().turn_speeds.read_text()) == {"b.gguf": [1.0]}
