"""The app's thread draws; it never waits on the database. Every statement the store's
connection runs is traced with the thread that ran it (sqlite3 calls the trace callback on
the thread executing the statement), and none may be the app's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from textual.widgets import Label

from localchat.tui.app import LocalChatApp
from localchat.tui.widgets.chat_message import UserMessage
from localchat.tui.widgets.prompt_input import PromptInput
from tests.tui_helpers import chat_app


@contextmanager
def statements_on_this_thread(app: LocalChatApp) -> Iterator[list[str]]:
    """The SQL the store runs on the calling thread (the app's, in a pilot test) meanwhile."""
    store = app.store
    assert store is not None
    here = threading.get_ident()
    seen: list[str] = []

    def trace(sql: str) -> None:
        if threading.get_ident() == here:
            seen.append(sql)

    store.db.set_trace_callback(trace)
    try:
        yield seen
    finally:
        store.db.set_trace_callback(None)


async def test_a_finished_turn_is_drawn_without_reading_the_database(tiny_model: Path) -> None:
    async with chat_app(tiny_model, n_ctx=1024, max_tokens=8) as ui:
        await ui.say("a first question")  # the next one is asked in a stored conversation
        with statements_on_this_thread(ui.app) as on_app_thread:
            finished = await ui.say("a second question")
            reply_drawn = not ui.app.chat.generating
        assert reply_drawn and on_app_thread == []
        assert finished.turn.user_branches == (1, 1)  # read where the turn ran instead


async def test_a_message_edited_switched_and_pinned_and_a_new_chat_read_the_database_off_it(
    tiny_model: Path,
) -> None:
    async with chat_app(tiny_model, size=(120, 40), n_ctx=2048, max_tokens=8) as ui:
        app, pilot = ui.app, ui.pilot
        for text in ("first question", "second question"):
            await ui.say(text)
        with statements_on_this_thread(app) as on_app_thread:
            await pilot.press("alt+up", "up")  # the last question
            assert isinstance(app.focused, UserMessage)
            await pilot.press("e")
            app.query_one(PromptInput).text = "an edited second question"
            await ui.send("enter")  # a new branch
            users = list(app.query(UserMessage))
            assert "2/2" in str(users[-1].query_one(".role", Label).render())
            users[-1].focus()
            await pilot.press("left")  # the old branch
            await ui.until(lambda: "branch 1 of 2" in ui.text("#turn-start"), "the old branch")
            app.query(UserMessage).first().focus()
            await pilot.press("p")
            await ui.notice("pinned")
            await app.chat.step_last_branch(1)  # the palette's Next branch
            await ui.until(lambda: "branch 2 of 2" in ui.text("#turn-start"), "the new branch")
            before = app.conversation
            await pilot.press("ctrl+n")
            await ui.opened(before=before)
        assert on_app_thread == []


async def test_the_conversations_screen_lists_searches_renames_exports_and_deletes_off_it(
    tiny_model: Path,
) -> None:
    from textual.widgets import DataTable, Input, TextArea

    from localchat.paths import app_paths
    from localchat.tui.screens.conversations import ConversationsScreen
    from localchat.tui.screens.text_prompt import TextPromptScreen

    async with chat_app(tiny_model, size=(120, 40), n_ctx=1024, max_tokens=8) as ui:
        app, pilot = ui.app, ui.pilot
        await ui.say("about the garden")
        store = app.store
        assert store is not None
        for name in ("groceries", "kv cache notes"):
            store.create_conversation(name, model="tiny")
        with statements_on_this_thread(app) as on_app_thread:
            await pilot.press("ctrl+l")
            screen = await ui.shown(ConversationsScreen)
            table = screen.query_one(DataTable)
            await ui.until(lambda: table.row_count == 3, "the conversations to be listed")
            await pilot.press(*"groceries")
            await ui.until(lambda: table.row_count == 1, "the search to narrow the list")
            await pilot.press("ctrl+e")
            exported = app_paths().data_dir / "exports" / "groceries.md"
            await ui.until(exported.exists, "the export to be written")
            await pilot.press("ctrl+r")
            prompt = await ui.shown(TextPromptScreen)
            prompt.query_one(TextArea).text = "shopping"
            await pilot.press("ctrl+s")
            search = screen.query_one("#conversation-search", Input)
            search.value = "kv cache"  # the rename lands before this search's rows
            await ui.until(
                lambda: table.row_count == 1 and "kv cache" in str(table.get_row_at(0)[0]),
                "the search for the other one",
            )
            await pilot.press("ctrl+d")
            await ui.until(lambda: table.row_count == 0, "the deleted conversation to go")
        assert on_app_thread == []
        assert store.get("groceries").title == "shopping"
        assert "kv cache notes" not in {r.name for r in store.conversations()}
        assert exported.read_text().startswith("#")
