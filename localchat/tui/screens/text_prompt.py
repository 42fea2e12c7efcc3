"""Ask for one piece of text (a new title, a system prompt, a file path)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, TextArea


class TextPromptScreen(ModalScreen[str | None]):
    """Ctrl+S saves, Esc cancels; the result is the text or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "save", "Save", id="prompt-save"),
        Binding("escape", "cancel", "Cancel", id="prompt-cancel"),
    ]

    def __init__(
        self, title: str, text: str = "", hint: str = "Ctrl+S saves · Esc cancels"
    ) -> None:
        super().__init__(classes="dialog-screen")
        self.prompt_title = title
        self.initial = text
        self.hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.prompt_title, classes="dialog-title")
            yield TextArea(self.initial, id="prompt-text")
            yield Label(self.hint, classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
