"""Shown when there is no model on disk and the hub cannot be reached."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class NoModelScreen(ModalScreen[str]):
    """Returns "demo" or the path of a local GGUF file."""

    def __init__(self, reason: str) -> None:
        super().__init__(classes="dialog-screen")
        self.reason = reason

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("No model to chat with", classes="dialog-title")
            yield Static(
                f"No model is on this machine yet, and none could be downloaded: {self.reason}.\n"
                "Chat with the demo model (SmolLM2-135M-Instruct where it can be fetched, else a"
                " generated one with random weights that talks nonsense), or open a GGUF file"
                " you have. A stopped download resumes the next time localchat starts."
            )
            yield Input(placeholder="/path/to/model.gguf", id="no-model-path")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Use the demo model", id="use-demo", variant="primary")
                yield Button("Open this file", id="use-file")

    @on(Button.Pressed, "#use-demo")
    def _demo(self) -> None:
        self.dismiss("demo")

    @on(Button.Pressed, "#use-file")
    @on(Input.Submitted, "#no-model-path")
    def _file(self) -> None:
        path = self.query_one(Input).value.strip()
        if not path:
            self.notify("Type the path of a .gguf file first.", severity="warning")
            return
        self.dismiss(path)
