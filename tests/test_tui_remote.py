"""The app on a server (the stand-in of tests/sse_server.py): live figures, stop, faults."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import DataTable, Markdown

from localchat.backends.remote import RemoteBackend
from localchat.paths import app_paths
from localchat.state.store import Store
from localchat.tui.messages import ModelLoaded, ReplyFailed, ReplyFinished
from localchat.tui.screens.models import ModelsScreen, RowsLoaded
from localchat.tui.widgets.prompt_input import PromptInput
from tests.sse_server import ServerScript, SSEServer
from tests.tui_helpers import chat_app

SIZE = (120, 36)


@pytest.fixture
def stand_in() -> Iterator[tuple[SSEServer, ServerScript]]:
    script = ServerScript()
    with SSEServer(script) as server:
        yield server, script


async def test_the_app_chats_through_a_server_with_live_figures(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    script.reply = ["Hello", " \x1b[31mthere\x1b[0m", " [b]friend[/b]"]
    async with chat_app(server=server.url, size=SIZE, max_tokens=64) as ui:
        assert "stand-in" in ui.text("#model-info") and "127.0.0.1" in ui.text("#model-info")
        finished = await ui.say("hi")
        assert finished.stats.generated_tokens == 3 and finished.stats.gen_tps > 0
        assert ui.text("#kv-memory") == "server-side (not published)"  # never zeros
        assert "≈" in ui.text("#ctx-tokens")  # no /tokenize on this server: estimated
        body = ui.app.query(Markdown).last()
        shown = body.source
        assert "\x1b" not in shown and "\\x1b[31m" in shown  # escapes made visible
        assert "[b]friend[/b]" in shown  # Rich markup stays text
        assert "first token" in ui.text("#speed")
    store = Store(app_paths().database)
    record = store.conversations()[0]
    assert [m.content for m in store.messages(record.id)] == ["hi", "".join(script.reply)]
    store.close()


async def test_esc_stops_a_server_reply_and_the_connection(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    script.first_token_delay_s = 30.0
    async with chat_app(server=server.url, size=SIZE, max_tokens=64) as ui:
        mark = len(ui.seen)
        await ui.pilot.press(*"hi", "enter")
        # Esc once the server has the request (its first token is 30 s away).
        await ui.until(lambda: script.requests, "the server to get the request")
        await ui.pilot.press("escape")
        finished = await ui.wait_for(ReplyFinished, after=mark, timeout_s=10)
        assert finished.stats.stop_reason == "cancelled"
        assert script.hung_up.wait(10)
        script.first_token_delay_s = 0.0
        again = await ui.say("again")  # the app stays usable
        assert again.stats.stop_reason == "eos" and again.stats.generated_tokens == 4


async def test_server_faults_are_one_line_and_nothing_is_lost(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    async with chat_app(server=server.url, size=SIZE, max_tokens=64) as ui:
        script.drop_after = 2
        await ui.say("first")  # cut mid-reply: the partial reply is kept
        await ui.notice("stream ended before the reply did")
        script.drop_after = None
        script.status = 500
        mark = len(ui.seen)
        await ui.pilot.press(*"second", "enter")
        failed = await ui.wait_for(ReplyFailed, after=mark)
        assert "HTTP 500" in failed.error
        assert "\n" not in failed.error
        await ui.until(lambda: not ui.app.chat.generating, "the failed turn to be taken back")
        assert ui.app.query_one(PromptInput).text == "second"  # handed back, not lost
    store = Store(app_paths().database)
    record = store.conversations()[0]
    stored = store.messages(record.id)
    assert [(m.role, m.content, m.status) for m in stored] == [
        ("user", "first", "complete"),
        ("assistant", "Hello,", "partial"),
    ]
    store.close()


async def test_an_unreachable_server_says_so_and_the_app_stays_up() -> None:
    async with chat_app(server="http://127.0.0.1:9/v1", size=SIZE, ready=False) as ui:
        await ui.notice("cannot reach 127.0.0.1:9")
        assert ui.app.is_running


async def test_models_screen_lists_server_models_and_switches_to_one(
    stand_in: tuple[SSEServer, ServerScript], tiny_model: Path
) -> None:
    server, script = stand_in
    script.models = [{"id": "stand-in", "max_model_len": 8192}, {"id": "other"}]
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(f'[[servers]]\nname = "box"\nurl = "{server.url}"\n')
    async with chat_app(tiny_model, size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        await ui.say("hello here")
        local = app.conversation
        name = local.record.name
        mark = len(ui.seen)
        await ui.pilot.press("ctrl+o")
        loaded_rows = await ui.wait_for(RowsLoaded, after=mark)
        assert [(r.server, r.model, r.context_size) for r in loaded_rows.server_rows] == [
            ("box", "stand-in", 8192),
            ("box", "other", None),
        ]
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        screen.query_one(DataTable).move_cursor(row=len(screen.rows))
        await ui.pilot.press("enter")
        loaded = await ui.wait_for(ModelLoaded, after=mark)
        assert isinstance(loaded.backend, RemoteBackend)
        await ui.opened(before=local)
        assert app.conversation.record.name == name  # the same conversation, on the server
        await ui.say("hello there")
        assert "ctx 8192" in ui.text("#model-info")
    store = Store(app_paths().database)
    record = store.find(name)
    contents = [m.content for m in store.messages(record.id)]
    assert contents[2:] == ["hello there", "Hello, world."] and len(contents) == 4
    assert script.requests[-1]["messages"][0]["content"] == "hello here"  # history went along
    store.close()
