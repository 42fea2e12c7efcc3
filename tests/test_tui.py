"""The real Textual app through App.run_test(), on generated models."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Collapsible, Static

import localchat.models.demo as demo_module
import localchat.models.loader as loader_module
import localchat.tui.widgets.reply_view as reply_view_module
from localchat.backends.compute_thread import on_compute_thread
from localchat.backends.llama.engine import Engine
from localchat.conversation.turn import ConversationTurn
from localchat.text import printable
from localchat.tui.messages import (
    ConversationRestored,
    ModelLoadFailed,
    ReplyChunk,
    ReplyFailed,
    ReplyFinished,
)
from localchat.tui.pacing import FramePacer
from localchat.tui.screens.hardware import HardwareScreen
from localchat.tui.widgets.chat_message import AssistantMessage, Notice, UserMessage
from localchat.tui.widgets.prompt_input import PromptInput

from .tui_helpers import ChatUI, chat_app


async def test_send_a_message_and_see_the_streamed_reply(tiny_model: Path) -> None:
    async with chat_app(tiny_model, n_ctx=512, max_tokens=40) as ui:
        finished = await ui.say("hello")
        app = ui.app
        assert app.query_one(UserMessage).text == "hello"
        reply = app.query_one(AssistantMessage)
        chunks = ui.posted(ReplyChunk)
        assert chunks and reply.raw == "".join(c.text for c in chunks)
        assert reply.raw == app.conversation.exchanges[-1].record.content
        assert reply.markdown.source == printable(reply.raw)  # all of it drawn at the end
        assert finished.stats.generated_tokens == 40
        assert app.query_one(PromptInput).text == ""
        # Live stats reflect the turn.
        tokens = finished.kv_tokens
        assert f"{tokens:,} / 512 tokens" == ui.text("#ctx-tokens")
        fill = str(app.screen.query_one("#ctx-fill").render())
        assert fill.endswith(f" {tokens * 100 // 512:3d}%") and "━" in fill
        # No thinking in this reply: no block for it (nothing to fold or lay out).
        assert not reply.reasoning.strip() and not reply.query(Collapsible)
        assert "tok/s" in ui.text("#speed")
        assert "KiB" in ui.text("#kv-memory")
        assert f"evaluated {finished.stats.prompt_tokens_evaluated}" in ui.text("#turn-start")


async def test_second_message_reuses_the_cache(tiny_model: Path) -> None:
    async with chat_app(tiny_model, n_ctx=1024, max_tokens=10) as ui:
        first = await ui.say("one")
        second = await ui.say("two")
        assert (
            second.stats.prompt_tokens_evaluated
            < second.stats.prompt_tokens - first.stats.prompt_tokens
        )
        assert "reused" in ui.text("#turn-start")


@pytest.mark.parametrize("how", ["ctrl+q", "exit"])
async def test_quitting_mid_reply_keeps_the_partial_reply(
    small_model: Path, isolated_home: Path, how: str
) -> None:
    """Ctrl+Q (or SIGTERM/SIGHUP, which call exit) while the model answers: the reply so far
    is committed and its state saved before the app is gone."""
    from localchat.paths import app_paths
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    async with chat_app(small_model, n_ctx=4096, max_tokens=3000) as ui:
        await ui.pilot.press(*"story", "enter")
        await ui.wait_for(ReplyChunk)
        name = ui.app.conversation.record.name
        fingerprint = ui.app.conversation.fingerprint
        if how == "ctrl+q":
            await ui.pilot.press("ctrl+q")
        else:
            ui.app.exit()
    finished = ui.posted(ReplyFinished)
    assert all(m.stats.stop_reason == "cancelled" for m in finished)  # it quit mid-reply
    store = Store(app_paths().database)
    conversation_id = store.get(name).id
    messages = store.messages(conversation_id)
    store.close()
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[-1].content and messages[-1].status == "partial"
    # And the state holding that partial reply was written before the process could end.
    saved = StateStore(app_paths().states_dir).path_for(conversation_id, fingerprint)
    assert saved.exists()


async def test_escape_stops_generation_and_keeps_the_partial_reply(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Drawing is not what this test is about (test_pacing is): no CPU share holds frames back,
    # which on a loaded machine, in a long test process, kept the first one past 30 s once.
    monkeypatch.setattr(
        reply_view_module, "FramePacer", lambda threads: FramePacer(threads, share=1.0)
    )
    async with chat_app(small_model, n_ctx=4096, max_tokens=3000) as ui:
        app = ui.app
        await ui.pilot.press(*"story", "enter")
        await ui.wait_for(ReplyChunk)
        reply = app.query_one(AssistantMessage)
        # The reply is drawn while it streams, not only at the end.
        await ui.until(
            lambda: reply.markdown.source or ui.posted(ReplyFinished),
            "the streaming reply's first frame",
            timeout_s=30,
        )
        assert reply.markdown.source and not ui.posted(ReplyFinished)
        await ui.pilot.press("escape")
        finished = await ui.wait_for(ReplyFinished)
        await ui.until(lambda: not app.chat.generating, "the stopped reply to be drawn")
        assert finished.stats.stop_reason == "cancelled"
        assert 0 < finished.stats.generated_tokens < 3000
        assert (
            app.query_one(AssistantMessage).raw
            == app.conversation.exchanges[-1].record.content
            != ""
        )
        assert app.query(Notice)


async def test_text_held_back_by_the_pacer_is_drawn_when_the_reply_ends(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pacer that allows no frame while streaming (a slow machine, a fast model): the whole
    reply still appears once generation ends."""
    monkeypatch.setattr(
        reply_view_module, "FramePacer", lambda threads: FramePacer(threads, share=0.0)
    )
    async with chat_app(small_model, n_ctx=1024, max_tokens=300) as ui:
        await ui.say("tell me more")
        reply = ui.app.query_one(AssistantMessage)
        assert len(ui.posted(ReplyChunk)) > 1
        assert reply.raw and reply.markdown.source == printable(reply.raw)


async def test_model_work_runs_on_the_compute_thread(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading and generating happen on the one compute thread (see compute_thread.py: a
    second OpenMP pool made generation 6 times slower on 2 cores)."""
    where: list[tuple[str, bool]] = []

    class RecordingEngine(Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            where.append(("load", on_compute_thread()))
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader_module, "Engine", RecordingEngine)  # the one way models load
    async with chat_app(tiny_model, n_ctx=512, max_tokens=5) as ui:
        conversation = ui.app.conversation
        assert conversation is not None
        real_send = conversation.send

        def send(*args: object, **kwargs: object) -> object:
            where.append(("send", on_compute_thread()))
            return real_send(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(conversation, "send", send)
        await ui.say("one")
        await ui.say("two")
    assert where == [("load", True), ("send", True), ("send", True)]


async def test_a_failed_send_puts_the_text_back(tiny_model: Path) -> None:
    typed = "my carefully written message"
    # A system prompt longer than the whole context: every send fails with a clear error.
    async with chat_app(tiny_model, n_ctx=64, max_tokens=10, system_prompt="rule " * 100) as ui:
        app = ui.app
        app.query_one(PromptInput).text = typed
        await ui.pilot.press("end", "enter")
        failed = await ui.wait_for(ReplyFailed)
        await ui.until(lambda: not app.chat.generating, "the failed turn to be taken back")
        assert "use --ctx" in failed.error
        assert app.query_one(PromptInput).text == typed
        assert not app.query(AssistantMessage) and not app.query(UserMessage)
        assert app.conversation.exchanges == []


async def test_a_model_that_fails_to_load_keeps_the_app_up(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_text("nope")
    async with chat_app(broken, ready=False) as ui:
        failed = await ui.wait_for(ModelLoadFailed)
        assert "not a GGUF file" in failed.error
        await ui.pilot.press(*"hi", "enter")
        await ui.notice("No model is loaded yet")  # Enter was taken, and turned down
        assert ui.app.query_one(PromptInput).text == "hi"
        assert ui.app.is_running


async def test_model_output_is_never_markup_or_escapes(tiny_model: Path) -> None:
    async with chat_app(tiny_model, ready=False, n_ctx=256) as ui:
        await ui.pilot.pause()
        reply = AssistantMessage()
        safe = reply.append("[bold red]x[/] \x1b[31mred\x1b[0m \x07")
        assert "\x1b" not in safe and "\x07" not in safe
        assert "[bold red]x[/]" in safe


async def test_reopening_the_app_resumes_from_the_saved_cache(tiny_model: Path) -> None:
    async with chat_app(tiny_model, n_ctx=1024, max_tokens=16) as first:
        await first.say("remember me")
        name = first.app.conversation.record.name
        reply_text = first.app.query_one(AssistantMessage).raw
    async with chat_app(tiny_model, n_ctx=1024, max_tokens=16) as second:
        app = second.app
        assert app.conversation.record.name == name
        assert app.query_one(UserMessage).text == "remember me"
        assert app.query_one(AssistantMessage).raw == reply_text
        # The saved cache is restored as the conversation opens, before anything is typed.
        await second.wait_for(ConversationRestored)
        assert "from saved cache" in second.text("#turn-start")
        finished = await second.say("and now")
        assert not finished.turn.restore.restored  # already in memory: a warm turn
        stats = finished.turn.stats_dict()
        assert stats["prompt_tokens_evaluated"] < stats["prompt_tokens"] // 2


async def test_the_conversation_says_when_the_window_moved(tiny_model: Path) -> None:
    async with chat_app(tiny_model, n_ctx=256, max_tokens=24) as ui:
        for i in range(12):
            finished = await ui.say(f"message {i} with a few more words")
            if finished.turn.window.dropped_messages:
                break
        notices = [str(n.render()) for n in ui.app.query(Notice)]
        assert any("left the context window (shift)" in n for n in notices)
        # Everything is still in the transcript.
        conversation = ui.app.conversation
        stored = conversation.store.messages(conversation.record.id)
        assert stored[0].content == "message 0 with a few more words"


async def test_pasting_100_kb_is_cut_to_fit_with_a_notice(tiny_model: Path) -> None:
    pasted = ("lorem ipsum dolor sit amet " * 4000)[:100_000]
    async with chat_app(tiny_model, n_ctx=1024, max_tokens=16) as ui:
        ui.app.query_one(PromptInput).text = pasted
        finished = await ui.send("end", "enter", timeout_s=120)
        assert finished.turn.window.cut_tokens > 0
        assert any("longer than the context" in str(n.render()) for n in ui.app.query(Notice))
        conversation = ui.app.conversation
        stored = conversation.store.messages(conversation.record.id)
        assert stored[0].content == pasted  # the transcript keeps every byte


async def test_after_demo_a_plain_start_reopens_the_demo_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo_module, "APP_DEMO_SHAPE", "tiny")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a download attempt would fail
    async with chat_app(demo=True, n_ctx=512, max_tokens=4) as first:
        await first.say("hello")
        demo_path = first.app.backend.model_path
    # Loaded and the conversation shown, no download.
    async with chat_app(n_ctx=512, max_tokens=4) as second:
        app = second.app
        assert app.backend is not None and app.backend.model_path == demo_path
        assert app.conversation is not None and len(app.conversation.exchanges) == 2


async def test_reply_messages_carry_copies_of_the_stats(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with chat_app(tiny_model, n_ctx=512, max_tokens=24) as ui:
        conversation = ui.app.conversation
        assert conversation is not None
        turns: list[ConversationTurn] = []  # the live turn the worker iterates
        real_send = conversation.send

        def send(*args: object, **kwargs: object) -> ConversationTurn:
            turns.append(real_send(*args, **kwargs))  # type: ignore[arg-type]
            return turns[-1]

        monkeypatch.setattr(conversation, "send", send)
        finished = await ui.say("hello there")
        chunks = ui.posted(ReplyChunk)
        assert chunks
        live = turns[-1].stats
        assert all(c.stats is not live for c in chunks) and finished.stats is not live
        assert len({id(c.stats) for c in chunks}) == len(chunks)
        assert finished.stats == live  # a copy of what the turn ended with


async def _hardware_report(ui: ChatUI) -> str:
    """F3, then the Hardware screen's report once its worker has filled it in."""
    await ui.pilot.press("f3")
    report = (await ui.shown(HardwareScreen)).query_one("#hardware-report", Static)
    await ui.until(lambda: "detecting" not in str(report.render()), "the hardware report")
    return str(report.render())


async def test_a_broken_models_toml_on_f3_is_a_notice_not_an_exit(tiny_model: Path) -> None:
    from localchat.paths import app_paths

    catalog = app_paths().user_catalog
    catalog.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_text('[[model]]\nname = "x"\nrepo = [broken\n')
    async with chat_app(tiny_model, n_ctx=512, max_tokens=4) as ui:
        report = await _hardware_report(ui)
        assert ui.app.is_running
        assert "models.toml" in report, report


async def test_a_worker_that_fails_unexpectedly_leaves_a_notice_and_the_app_up(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_failure(*_args: object, **_kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", "/data/[bold]models[/bold].toml")

    monkeypatch.setattr("localchat.tui.screens.hardware.detect_hardware", disk_failure)
    async with chat_app(tiny_model, n_ctx=512, max_tokens=4) as ui:
        await ui.pilot.press("f3")
        await ui.notice("Permission denied")
        assert ui.app.is_running
        notes = ui.notices()
        assert any("Permission denied (/data/[bold]models[/bold].toml)" in n for n in notes), notes
        assert all(not n.markup for n in ui.notifications())


async def test_the_hardware_screen_plans_with_the_speed_setting(tiny_model: Path) -> None:
    from localchat.models.speed import SpeedModel, machine_name
    from localchat.paths import app_paths

    costs = {"F16": 3.7e-11, "Q8_0": 5e-11, "Q6_K": 7e-11, "Q4_K": 5.2e-11, "Q2_K": 7.4e-11}
    SpeedModel(costs, 1e-4, costs, 1e-5, machine_name(), 2).save(app_paths().speed_calibration)

    reports = {}
    for wanted in ("0.5", "500"):
        settings = app_paths().settings_file
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(f"min_tokens_per_s = {wanted}\n")
        async with chat_app(tiny_model, n_ctx=512, max_tokens=4) as ui:
            reports[wanted] = await _hardware_report(ui)
    assert "tok/s here" in reports["0.5"] and "under the 500 tok/s wanted" in reports["500"]
    assert "under the" not in reports["0.5"]


async def test_closing_and_opening_a_conversation_stay_off_the_event_loop(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from localchat.conversation.local import Conversation

    on_loop: list[tuple[str, bool]] = []
    real_open = Conversation.open.__func__  # type: ignore[attr-defined]

    def open_(cls: type, *args: object, **kwargs: object) -> object:
        on_loop.append(("open", threading.current_thread() is threading.main_thread()))
        return real_open(cls, *args, **kwargs)

    monkeypatch.setattr(Conversation, "open", classmethod(open_))
    async with chat_app(tiny_model, n_ctx=512, max_tokens=4) as ui:
        await ui.say("hello")
        first = ui.app.conversation
        assert first is not None
        real_close = first.close

        def close() -> None:
            on_loop.append(("close", threading.current_thread() is threading.main_thread()))
            real_close()

        monkeypatch.setattr(first, "close", close)
        await ui.pilot.press("ctrl+n")
        await ui.opened(before=first)
        assert ui.app.conversation is not None and ui.app.conversation is not first
    assert ("close", False) in on_loop
    assert on_loop and all(not loop for _what, loop in on_loop), on_loop
