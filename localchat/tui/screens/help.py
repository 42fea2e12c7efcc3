"""Every key the app knows, from its bindings (so the list cannot go stale)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Close", id="help-close")]

    def __init__(self, bindings: list[Binding], message_bindings: Sequence[Binding] = ()) -> None:
        """``message_bindings``: the keys of a selected message in the log."""
        super().__init__(classes="dialog-screen")
        self.app_bindings = bindings
        self.message_bindings = list(message_bindings)

    def compose(self) -> ComposeResult:
        table = Table(show_header=True, box=None, padding=(0, 2))
        table.add_column("Key")
        table.add_column("Action")
        table.add_column("What it does")
        table.add_row("Enter", "Send", "Send the message")
        table.add_row("Shift+Enter / Ctrl+J", "New line", "Start a new line in the message")
        for binding in self.app_bindings:
            table.add_row(self.app.get_key_display(binding), binding.description, binding.tooltip)
        table.add_row("Ctrl+P", "Commands", "Every action, searchable")
        if self.message_bindings:
            table.add_row("", "", "")
            table.add_row("", "A selected message", "")
            for binding in self.message_bindings:
                key = self.app.get_key_display(binding)
                table.add_row(key, binding.description, binding.tooltip)
        with VerticalScroll(classes="dialog wide"):
            yield Label("Keys", classes="dialog-title")
            yield Static(table)
            yield Label("Esc closes", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
