"""One message in the chat log: the user's as plain text, the model's as streamed Markdown."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Markdown, Static

from localchat.text import printable


class UserMessage(Vertical):
    def __init__(self, text: str) -> None:
        super().__init__(classes="message user")
        self.text = text

    def compose(self) -> ComposeResult:
        yield Label("you", classes="role")
        # A Text object: the user's words are never parsed as Rich markup.
        yield Static(Text(self.text), classes="body")


class AssistantMessage(Vertical):
    """Model output is text: control characters are made visible before rendering."""

    def __init__(self) -> None:
        super().__init__(classes="message assistant")
        self.raw = ""

    def compose(self) -> ComposeResult:
        yield Label("model", classes="role")
        yield Markdown(classes="body")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def append(self, text: str) -> str:
        """Record ``text`` and return its safe form for the Markdown stream."""
        self.raw += text
        return printable(text)


class Notice(Static):
    """A system notice inside the conversation (window moved, state restored…)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), classes="notice")
