"""The app's benchmark machinery: both sides of the overhead comparison run and agree."""

from __future__ import annotations

from pathlib import Path

from localchat.tui import bench_ui

SIDES = ("headless", "app")


def test_the_app_and_headless_turns_produce_the_same_reply(tiny_model: Path) -> None:
    """Each side runs in a fresh process; the comparison is only valid on identical replies."""
    runs = {side: bench_ui._turn_in_fresh_process(side, tiny_model, 24) for side in SIDES}
    assert runs["headless"]["tokens"] == runs["app"]["tokens"] == 24
    for run in runs.values():  # both sides measured their own CPU time and speed
        assert run["cpu_s"] > 0 and run["gen_tps"] > 0


def test_startup_is_timed_in_a_fresh_process(tiny_model: Path) -> None:
    startup = bench_ui._startup_once(tiny_model)
    assert 0.0 < startup < 60.0
