"""A tool call waits for the user: run it once, always run this tool in this conversation,
or deny it (the model is told). The call is shown as text, never as markup."""

from __future__ import annotations

import json
import time
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from localchat.chat.tools import ToolCall
from localchat.text import printable
from localchat.tools.consent import ALWAYS, DENY, RUN_ONCE

# It opens by itself when a reply ends, maybe while the user types: keys pressed this soon
# after are not an answer.
ARMED_AFTER_S = 0.6


class ToolConsentScreen(ModalScreen[str]):
    """The buttons answer (Tab or the arrows move between them); Esc denies. No letter keys:
    the dialog opens while the user may be typing."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "answer('deny')", "Deny", id="consent-deny"),
        Binding("left", "app.focus_previous", show=False, id="consent-previous"),
        Binding("right", "app.focus_next", show=False, id="consent-next"),
    ]

    def __init__(self, call: ToolCall, server: str | None) -> None:
        super().__init__(classes="dialog-screen")
        self.call = call
        self.server = server
        self._armed_at = float("inf")  # from when it is shown

    def compose(self) -> ComposeResult:
        arguments = json.dumps(self.call.arguments, indent=2, ensure_ascii=False)
        where = f" (MCP server {self.server})" if self.server else ""
        with Vertical(classes="dialog wide"):
            yield Label(
                Text(f"The model wants to run {self.call.name}{where}"), classes="dialog-title"
            )
            yield Static(Text(printable(arguments)), id="consent-arguments")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Run once", id=RUN_ONCE, variant="primary")
                yield Button(f"Always run {self.call.name} here", id=ALWAYS)
                yield Button("Deny", id=DENY, variant="error")
            yield Label(
                "O runs once · A always, in this conversation · Esc denies", classes="dialog-hint"
            )

    def on_mount(self) -> None:
        self._armed_at = time.monotonic() + ARMED_AFTER_S
        self.query_one(f"#{RUN_ONCE}", Button).focus()

    @property
    def armed(self) -> bool:
        """Whether a button press now is an answer (not a key typed for the message box)."""
        return time.monotonic() >= self._armed_at

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        if self.armed:
            self.dismiss(event.button.id or DENY)

    def action_answer(self, choice: str) -> None:
        self.dismiss(choice)  # Esc: denying is always safe
