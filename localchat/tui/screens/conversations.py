"""Conversations: search titles and text, resume, rename, delete, export."""

from __future__ import annotations

import time
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from localchat.atomic import write_atomic
from localchat.conversation.records import delete_conversation
from localchat.errors import LocalchatError
from localchat.paths import app_paths
from localchat.state.export import export_markdown
from localchat.state.images import ImageStore
from localchat.state.kvstate import StateStore
from localchat.state.store import ConversationRecord, Store
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.worker_failures import ReportsWorkerFailures


class ConversationsScreen(ModalScreen[str | None], ReportsWorkerFailures):
    """Returns the name of the conversation to open, or None. The list and every change to
    it are read and written in thread workers: the app's thread only draws."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="conversations-close"),
        Binding("enter", "open", "Open", id="conversations-open", priority=True),
        # Priority: the search box would otherwise take these keys for editing.
        Binding("ctrl+r", "rename", "Rename", id="conversations-rename", priority=True),
        Binding("ctrl+d", "delete", "Delete", id="conversations-delete", priority=True),
        Binding("ctrl+e", "export", "Export", id="conversations-export", priority=True),
    ]

    class Listed(Message):
        """The conversations the search finds, read off the app's thread."""

        def __init__(self, search: str | None, records: list[ConversationRecord]) -> None:
            super().__init__()
            self.search = search
            self.records = records

    def __init__(self, store: Store, states: StateStore, current: str | None) -> None:
        super().__init__(classes="dialog-screen")
        self.store = store
        self.states = states
        self.current = current
        self._search_text: str | None = None
        self._records: dict[str, ConversationRecord] = {}  # the rows shown, by name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label("Conversations", classes="dialog-title")
            yield Input(placeholder="Search titles and messages", id="conversation-search")
            yield DataTable(id="conversation-table", cursor_type="row", zebra_stripes=True)
            yield Label(
                "Enter opens · Ctrl+R renames · Ctrl+D deletes · Ctrl+E exports · Esc closes",
                classes="dialog-hint",
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Title", "Messages", "Updated", "Model")
        self.refresh_rows()
        self.query_one(Input).focus()

    @on(Input.Changed, "#conversation-search")
    def _search(self, event: Input.Changed) -> None:
        self._search_text = event.value.strip() or None
        self.refresh_rows()

    @work(thread=True, exclusive=True, group="conversation list", exit_on_error=False)
    def refresh_rows(self) -> None:
        """Read the conversations the search finds (a read for an older search is dropped)."""
        search = self._search_text
        self.post_message(self.Listed(search, self.store.conversations(search)))

    @on(Listed)
    def _show_rows(self, message: Listed) -> None:
        if message.search != self._search_text:
            return
        table = self.query_one(DataTable)
        table.clear()
        self._records = {record.name: record for record in message.records}
        for record in message.records:
            updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.updated_at))
            marker = " ●" if record.name == self.current else ""
            table.add_row(
                record.title + marker,
                str(record.message_count),
                updated,
                record.model or "-",
                key=record.name,
            )

    def _selected(self) -> ConversationRecord | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        name = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return self._records.get(str(name))

    def action_open(self) -> None:
        record = self._selected()
        if record is not None:
            self.dismiss(record.name)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_rename(self) -> None:
        record = self._selected()
        if record is None:
            return

        def rename(title: str | None) -> None:
            if title:
                self._rename(record, title)

        self.app.push_screen(TextPromptScreen(f"Rename “{record.title}”", record.title), rename)

    @work(thread=True, group="conversation change", exit_on_error=False)
    def _rename(self, record: ConversationRecord, title: str) -> None:
        self.store.update_conversation(record.id, title=title)
        self.app.call_from_thread(self.refresh_rows)

    def action_delete(self) -> None:
        record = self._selected()
        if record is None:
            return
        if record.name == self.current:
            self.notify(
                "This conversation is open; start or open another one first.", severity="warning"
            )
            return
        self._delete(record.name)

    @work(thread=True, group="conversation change", exit_on_error=False)
    def _delete(self, name: str) -> None:
        try:
            images = ImageStore(app_paths().images_dir)
            delete_conversation(self.store, self.states, images, name)
        except LocalchatError as exc:
            self.notify(str(exc), severity="error", markup=False)  # thread-safe
            return
        self.notify(f"Deleted “{name}”.", markup=False)  # a name is the user's text
        self.app.call_from_thread(self.refresh_rows)

    def action_export(self) -> None:
        record = self._selected()
        if record is not None:
            self._export(record)

    @work(thread=True, group="conversation export", exit_on_error=False)
    def _export(self, record: ConversationRecord) -> None:
        target = app_paths().data_dir / "exports" / f"{record.name}.md"
        write_atomic(target, export_markdown(record, self.store.messages(record.id)).encode())
        self.notify(f"Exported to {target}", markup=False)
