"""One message in the chat log: the user's as plain text, the model's as streamed Markdown."""

from __future__ import annotations

import functools

from markdown_it import MarkdownIt
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static

from localchat.text import printable

# Takes the parser down each of its paths (linkify compiles its patterns on first use).
_WARM_UP_SAMPLE = (
    "# Title\n\nSome *text* with `code`, https://example.com/a, www.example.org,"
    " example.net and someone@example.com\n\n- item\n\n| a |\n|---|\n| 1 |\n"
)


@functools.cache
def markdown_parser() -> MarkdownIt:
    """The one parser every reply uses (Textual's default builds a new one per streamed chunk,
    and its link patterns are compiled again whenever Python's regex cache has dropped them)."""
    return MarkdownIt("gfm-like")


def warm_up_markdown() -> None:
    """Parse a sample once, off the app's thread: the patterns the parser compiles on first use
    then do not delay the first reply's first frame."""
    markdown_parser().parse(_WARM_UP_SAMPLE)


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

    def __init__(self, text: str = "", reasoning: str = "") -> None:
        """A reply being streamed (empty), or a stored one with its answer and thinking."""
        super().__init__(classes="message assistant")
        self.raw = text  # the answer as the model wrote it
        self.reasoning = reasoning  # a reasoning model's thinking, dimmed and collapsible

    def compose(self) -> ComposeResult:
        yield Label("model", classes="role")
        # A stored reply's thinking starts folded: its answer is what is read.
        with Collapsible(title="reasoning", collapsed=bool(self.raw.strip()), classes="reasoning"):
            yield Static(Text(printable(self.reasoning.strip())), classes="reasoning-text")
        yield Markdown(printable(self.raw), classes="body", parser_factory=markdown_parser)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def append_reasoning(self, text: str) -> None:
        """Show more of the thinking (as text: never markup)."""
        self.reasoning += text
        self.query_one(".reasoning-text", Static).update(Text(printable(self.reasoning.strip())))
        self.query_one(Collapsible).display = bool(self.reasoning.strip())

    def collapse_reasoning(self) -> None:
        self.query_one(Collapsible).collapsed = True

    def on_mount(self) -> None:
        self.query_one(Collapsible).display = bool(self.reasoning.strip())

    def append(self, text: str) -> str:
        """Record ``text`` and return its safe form for the Markdown stream."""
        self.raw += text
        return printable(text)


class Notice(Static):
    """A system notice inside the conversation (window moved, state restored…)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), classes="notice")
