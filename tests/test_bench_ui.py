"""The app's benchmark machinery: both sides of the overhead comparison run and agree."""

from __future__ import annotations

from pathlib import Path

from localchat.tui import bench_ui


def test_the_app_and_headless_turns_produce_the_same_reply(tiny_model: Path) -> None:
    """Each side runs in a fresh process; the comparison is only valid on identical replies."""
    overhead, rate, tokens = bench_ui._overhead(tiny_model, max_tokens=24, rounds=1)
    assert tokens == 24
    assert rate > 0
    assert overhead > -1.0  # a fraction of the headless CPU time, finite


def test_startup_is_timed_in_a_fresh_process(tiny_model: Path) -> None:
    startup = bench_ui._startup_once(tiny_model)
    assert 0.0 < startup < 60.0
