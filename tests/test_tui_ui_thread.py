"""The app's thread draws; it never waits on the database. Every statement the store's
connection runs is traced with the thread that ran it (sqlite3 calls the trace callback on
the thread executing the statement), and none may be the app's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from localchat.tui.app import LocalChatApp
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
