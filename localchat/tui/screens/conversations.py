"""Conversations: search titles and text, resume, rename, delete, export."""

from __future__ import annotations

import time
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label

from localchat.atomic import write_atomic
from localchat.conversation.records import delete_conversation
from localchat.errors import LocalchatError
from localchat.paths import app_paths
from localchat.state.export import export_markdown
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.screens.text_prompt import TextPromptScreen


class ConversationsScreen(ModalScreen[str | None]):
    """Returns the name of the conversation to open, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="conversations-close"),
        Binding("enter", "open", "Open", id="conversations-open", priority=True),
        # Priority: the search box would otherwise take these keys for editing.
        Binding("ctrl+r", "rename", "Rename", id="conversations-rename", priority=True),
        Binding("ctrl+d", "delete", "Delete", id="conversations-delete", priority=True),
        Binding("ctrl+e", "export", "Export", id="conversations-export", priority=True),
    ]

    def __init__(self, store: Store, states: StateStore, current: str | None) -> None:
        super().__init__(classes="dialog-screen")
        self.store = store
        self.states = states
        self.current = current

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
        self.refresh_rows(event.value.strip() or None)

    def refresh_rows(self, search: str | None = None) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for record in self.store.conversations(search):
            updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.updated_at))
            marker = " ●" if record.name == self.current else ""
            table.add_row(
                record.title + marker,
                str(record.message_count),
                updated,
                record.model or "-",
                key=record.name,
            )

    def _selected(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def action_open(self) -> None:
        name = self._selected()
        if name is not None:
            self.dismiss(name)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_rename(self) -> None:
        name = self._selected()
        if name is None:
            return
        record = self.store.get(name)

        def rename(title: str | None) -> None:
            if title:
                self.store.update_conversation(record.id, title=title)
                self.refresh_rows()

        self.app.push_screen(TextPromptScreen(f"Rename “{record.title}”", record.title), rename)

    def action_delete(self) -> None:
        name = self._selected()
        if name is None:
            return
        if name == self.current:
            self.notify(
                "This conversation is open; start or open another one first.", severity="warning"
            )
            return
        try:
            delete_conversation(self.store, self.states, name)
        except LocalchatError as exc:
            self.notify(str(exc), severity="error")
            return
        self.notify(f"Deleted “{name}”.")
        self.refresh_rows()

    def action_export(self) -> None:
        name = self._selected()
        if name is None:
            return
        record = self.store.get(name)
        target = app_paths().data_dir / "exports" / f"{record.name}.md"
        write_atomic(target, export_markdown(record, self.store.messages(record.id)).encode())
        self.notify(f"Exported to {target}")
