"""The app's benchmark machinery: both sides of the overhead comparison run and agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.bench.app import measure as bench_ui
from tests.conftest import GREEDY

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


def test_the_first_turn_after_opening_is_measured_on_a_restored_conversation(
    tiny_model: Path, tmp_path: Path
) -> None:
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    home = tmp_path / "saved"
    engine = Engine(tiny_model, LoadOptions(n_ctx=1024))
    store = Store(home / "data" / "conversations.sqlite3")
    conversation = Conversation.open(store, StateStore(home / "data" / "states"), "long", engine)
    for text in ("one " * 40, "two " * 40):
        for _ in conversation.send(text, GREEDY, 16):
            pass
    conversation.saver.wait()
    conversation.close()
    store.close()
    engine.close()
    figures = bench_ui.app_resume_vs_warm(tiny_model, home, "long", ("a b c", "d e f"), 1024, 1)
    assert figures["app_first_turn_ttft_s"] > 0 and figures["app_warm_turn_ttft_s"] > 0
    assert figures["app_resume_vs_warm"] > 0


def test_the_type_ahead_figure_types_into_the_app_and_reads_ahead(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_ui, "TYPING_CHARS_PER_S", 200.0)  # the test types quickly
    message = "the model keeps a cache of every token it has read so far " * 2
    figures = bench_ui.app_type_ahead(tiny_model, [message.strip()], 1024)
    assert figures["typeahead_read_ahead_tokens"] > 10  # read while it was typed
    assert figures["typeahead_ttft_s"] > 0 and figures["typed_cold_ttft_s"] > 0
    assert figures["one_word_ttft_s"] > 0 and figures["typeahead_vs_one_word"] > 0
