"""The app on a server (the stand-in of tests/sse_server.py): live figures, stop, faults."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.message import Message
from textual.widgets import DataTable, Markdown, Static

from localchat.backends.base import Sampling
from localchat.backends.remote import RemoteBackend
from localchat.paths import app_paths
from localchat.state.store import Store
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ModelLoaded, ReplyFailed, ReplyFinished
from localchat.tui.screens.models import ModelsScreen, RowsLoaded
from localchat.tui.widgets.prompt_input import PromptInput
from tests.sse_server import ServerScript, SSEServer
from tests.tui_helpers import ready, say, wait_for


@pytest.fixture
def stand_in() -> Iterator[tuple[SSEServer, ServerScript]]:
    script = ServerScript()
    with SSEServer(script) as server:
        yield server, script


def _app(server: SSEServer) -> tuple[LocalChatApp, list[Message]]:
    app = LocalChatApp(server=server.url, sampling=Sampling(temperature=0.0), max_tokens=64)
    return app, []


def _text(app: LocalChatApp, widget_id: str) -> str:
    return str(app.query_one(widget_id, Static).render())


async def test_the_app_chats_through_a_server_with_live_figures(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    script.reply = ["Hello", " \x1b[31mthere\x1b[0m", " [b]friend[/b]"]
    app, seen = _app(server)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        assert "stand-in" in _text(app, "#model-info") and "127.0.0.1" in _text(app, "#model-info")
        finished = await say(pilot, seen, "hi")
        assert finished.stats.generated_tokens == 3 and finished.stats.gen_tps > 0
        assert _text(app, "#kv-memory") == "server-side (not published)"  # never zeros
        assert "≈" in _text(app, "#ctx-tokens")  # no /tokenize on this server: estimated
        body = app.query(Markdown).last()
        shown = body.source
        assert "\x1b" not in shown and "\\x1b[31m" in shown  # escapes made visible
        assert "[b]friend[/b]" in shown  # Rich markup stays text
        assert "first token" in _text(app, "#speed")
    store = Store(app_paths().database)
    record = store.conversations()[0]
    assert [m.content for m in store.messages(record.id)] == ["hi", "".join(script.reply)]
    store.close()


async def test_esc_stops_a_server_reply_and_the_connection(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    script.first_token_delay_s = 30.0
    app, seen = _app(server)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        mark = len(seen)
        await pilot.press(*"hi", "enter")
        await pilot.pause(0.5)
        await pilot.press("escape")
        finished = await wait_for(pilot, seen, ReplyFinished, timeout_s=10, after=mark)
        assert isinstance(finished, ReplyFinished)
        assert finished.stats.stop_reason == "cancelled"
        assert script.hung_up.wait(10)
        script.first_token_delay_s = 0.0
        again = await say(pilot, seen, "again")  # the app stays usable
        assert again.stats.stop_reason == "eos" and again.stats.generated_tokens == 4


async def test_server_faults_are_one_line_and_nothing_is_lost(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    app, seen = _app(server)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        script.drop_after = 2
        await say(pilot, seen, "first")  # cut mid-reply: the partial reply is kept
        assert any("stream ended before the reply did" in n.message for n in app._notifications)
        script.drop_after = None
        script.status = 500
        mark = len(seen)
        await pilot.press(*"second", "enter")
        failed = await wait_for(pilot, seen, ReplyFailed, after=mark)
        assert isinstance(failed, ReplyFailed) and "HTTP 500" in failed.error
        assert "\n" not in failed.error
        assert app.query_one(PromptInput).text == "second"  # handed back, not lost
    store = Store(app_paths().database)
    record = store.conversations()[0]
    stored = store.messages(record.id)
    assert [(m.role, m.content, m.status) for m in stored] == [
        ("user", "first", "complete"),
        ("assistant", "Hello,", "partial"),
    ]
    store.close()


async def test_an_unreachable_server_says_so_and_the_app_stays_up() -> None:
    app = LocalChatApp(server="http://127.0.0.1:9/v1")
    seen: list[Message] = []
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        for _ in range(100):
            if app._notifications:
                break
            await pilot.pause(0.05)
        messages = [n.message for n in app._notifications]
        assert any("cannot reach 127.0.0.1:9" in m for m in messages)
        assert app.is_running


async def test_models_screen_lists_server_models_and_switches_to_one(
    stand_in: tuple[SSEServer, ServerScript], tiny_model: Path
) -> None:
    server, script = stand_in
    script.models = [{"id": "stand-in", "max_model_len": 8192}, {"id": "other"}]
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(f'[[servers]]\nname = "box"\nurl = "{server.url}"\n')
    app = LocalChatApp(tiny_model, n_ctx=1024, max_tokens=8, sampling=Sampling(temperature=0.0))
    seen: list[Message] = []
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        await say(pilot, seen, "hello here")
        name = app.conversation.record.name
        mark = len(seen)
        await pilot.press("ctrl+o")
        loaded_rows = await wait_for(pilot, seen, RowsLoaded, after=mark)
        assert isinstance(loaded_rows, RowsLoaded)
        assert [(r.server, r.model, r.context_size) for r in loaded_rows.server_rows] == [
            ("box", "stand-in", 8192),
            ("box", "other", None),
        ]
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        screen.query_one(DataTable).move_cursor(row=len(screen.rows))
        await pilot.press("enter")
        loaded = await wait_for(pilot, seen, ModelLoaded, after=mark)
        assert isinstance(loaded, ModelLoaded) and isinstance(loaded.backend, RemoteBackend)
        await pilot.pause(0.3)
        assert app.conversation.record.name == name  # the same conversation, on the server
        await say(pilot, seen, "hello there")
        assert "ctx 8192" in _text(app, "#model-info")
    store = Store(app_paths().database)
    record = store.find(name)
    contents = [m.content for m in store.messages(record.id)]
    assert contents[2:] == ["hello there", "Hello, world."] and len(contents) == 4
    assert script.requests[-1]["messages"][0]["content"] == "hello here"  # history went along
    store.close()
