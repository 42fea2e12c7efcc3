"""One message in the chat log: the user's as plain text, the model's as streamed Markdown."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import ClassVar

from markdown_it import MarkdownIt
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets._markdown import MarkdownParagraph  # not re-exported by Textual
from textual.widgets.markdown import MarkdownBlock

from localchat.chat.tools import ToolCall
from localchat.text import printable
from localchat.tui.widgets.image_view import ImageLine, ImageView

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


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced or indented code block in a reply, in order."""
    blocks = []
    for token in markdown_parser().parse(text):
        if token.type in ("fence", "code_block"):
            blocks.append((token.info.strip(), token.content))
    return blocks


def warm_up_markdown() -> None:
    """Parse a sample once, off the app's thread: the patterns the parser compiles on first use
    then do not delay the first reply's first frame."""
    markdown_parser().parse(_WARM_UP_SAMPLE)


class ChatEntry(Vertical, can_focus=True):
    """A message in the log that can be selected (Shift+Tab from the message box, then the
    arrows): its keys act on it. ``message_id`` is its stored record (None while a reply is
    still being written)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "step(-1)", "Previous", show=False, id="message-previous"),
        Binding("down", "step(1)", "Next", show=False, id="message-next"),
        Binding("c", "copy", "Copy", tooltip="Copy this message's text", id="message-copy"),
        Binding("p", "pin", "Pin", tooltip="Pin: it never leaves the context window", id="pin"),
        Binding(
            "f",
            "fork",
            "Fork",
            tooltip="A new conversation with the messages up to this one (from the saved cache)",
            id="fork",
        ),
        Binding("tab", "leave", "Back", tooltip="Back to the message box", id="message-back"),
    ]

    @dataclass
    class Edit(Message):
        """Edit this (user) message: what is sent instead starts a new branch from it."""

        message_id: int

    @dataclass
    class Pin(Message):
        """Pin this message (or unpin it)."""

        message_id: int

    @dataclass
    class Fork(Message):
        """A new conversation holding the messages up to this one."""

        message_id: int

    @dataclass
    class SwitchBranch(Message):
        """Show the branch ``step`` places from the one this message is on."""

        message_id: int
        step: int

    ROLE = ""

    def __init__(self, classes: str, message_id: int | None) -> None:
        super().__init__(classes=classes)
        self.message_id = message_id

    @property
    def copy_text(self) -> str:
        raise NotImplementedError

    def role_text(self) -> str:
        """The line above the message: who wrote it, pinned, out of the model's sight."""
        marks = [self.ROLE]
        if self.has_class("pinned"):
            marks.append("pinned")
        if self.has_class("out-of-window"):
            marks.append("no longer in the context")
        return " · ".join(marks)

    def show_window(self, pinned: bool, seen: bool) -> None:
        """Mark it pinned, and dim it once the model no longer sees it."""
        self.set_class(pinned, "pinned")
        self.set_class(not seen, "out-of-window")
        if self.is_mounted:
            self.query_one(".role", Label).update(self.role_text())

    def action_pin(self) -> None:
        if self.message_id is not None:
            self.post_message(self.Pin(self.message_id))

    def action_fork(self) -> None:
        if self.message_id is not None:
            self.post_message(self.Fork(self.message_id))

    def action_step(self, step: int) -> None:
        entries = list(self.screen.query(ChatEntry))
        place = entries.index(self) + step
        if 0 <= place < len(entries):
            entries[place].focus()
            entries[place].scroll_visible(animate=False)
        elif step > 0:
            self.action_leave()

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.copy_text)
        self.app.notify("Copied the message.")

    def action_leave(self) -> None:
        self.screen.query_one("#input").focus()


class UserMessage(ChatEntry):
    ROLE = "you"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("e", "edit", "Edit", tooltip="Edit: sent again, it starts a new branch", id="edit"),
        Binding("left", "branch(-1)", "◀ Branch", tooltip="The previous branch", id="branch-prev"),
        Binding("right", "branch(1)", "Branch ▶", tooltip="The next branch", id="branch-next"),
    ]

    def __init__(
        self,
        text: str,
        message_id: int | None = None,
        branch: tuple[int, int] = (1, 1),
        images: tuple[ImageLine, ...] = (),
    ) -> None:
        """``branch``: (which, how many) branches start at this message; ``images``: the
        images it shows, before its text."""
        super().__init__("message user", message_id)
        self.text = text
        self.branch = branch
        self.images = images

    @property
    def copy_text(self) -> str:
        return self.text

    def role_text(self) -> str:
        which, count = self.branch
        text = super().role_text()
        return f"{text}  ◀ {which}/{count} ▶" if count > 1 else text

    def compose(self) -> ComposeResult:
        yield Label(self.role_text(), classes="role")
        for image in self.images:
            yield ImageView(image)
        # A Text object: the user's words are never parsed as Rich markup.
        yield Static(Text(self.text), classes="body")

    def show_branch(self, branch: tuple[int, int]) -> None:
        """Redraw the role line with ``branch`` (an unchanged one costs no relayout)."""
        if branch == self.branch:
            return
        self.branch = branch
        if self.is_mounted:
            self.query_one(".role", Label).update(self.role_text())

    def action_edit(self) -> None:
        if self.message_id is not None:
            self.post_message(self.Edit(self.message_id))

    def action_branch(self, step: int) -> None:
        if self.message_id is not None:
            self.post_message(self.SwitchBranch(self.message_id, step))


class SteadyParagraph(MarkdownParagraph):
    """A paragraph of a streaming reply: text that still fits its lines repaints the
    paragraph alone; only a paragraph that grows a line lays the screen out again (a layout
    of the whole chat costs tens of milliseconds of the app's thread, taken from generation
    on a small machine). A paragraph without links skips Textual's link styling, which
    rebuilds every line of the paragraph at each repaint (half of a 7,000-character
    paragraph's 55 ms frame)."""

    def set_content(self, content: Content) -> None:
        self.auto_links = any(_is_link(span.style) for span in content.spans)
        width = self.size.width
        if not self.is_mounted or width <= 0:
            super().set_content(content)
            return
        self._content = content
        self.update(content, layout=False)
        if self.get_content_height(self.size, self.size, width) != self.size.height:
            self.refresh(layout=True)


def _is_link(style: object) -> bool:
    """Whether a Markdown span's style makes it clickable (links and images)."""
    return "@click" in (getattr(style, "meta", None) or {})


class ReplyMarkdown(Markdown):
    """A reply's Markdown, its paragraphs steady while they stream."""

    # Textual declares BLOCKS without ClassVar: the same declaration here.
    BLOCKS: dict[str, type[MarkdownBlock]] = {  # noqa: RUF012
        **Markdown.BLOCKS,
        "paragraph_open": SteadyParagraph,
    }


class AssistantMessage(ChatEntry):
    """Model output is text: control characters are made visible before rendering."""

    ROLE = "model"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "k",
            "copy_code",
            "Copy code",
            tooltip="Copy its last code block (again: the one before)",
            id="copy-code",
        ),
    ]

    def __init__(self, text: str = "", reasoning: str = "", message_id: int | None = None) -> None:
        """A reply being streamed (empty), or a stored one with its answer and thinking."""
        super().__init__("message assistant", message_id)
        self.raw = text  # the answer as the model wrote it
        self.reasoning = reasoning  # a reasoning model's thinking, dimmed and collapsible
        self._code_pick = 0  # the code block copied last, counted from the end
        self._reasoning_text: Static | None = None  # in its block, once there is thinking

    @property
    def copy_text(self) -> str:
        return self.raw

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.raw)
        if not blocks:
            self.app.notify("No code block in this reply.")
            return
        # Each press goes one block further back, from the last.
        self._code_pick = (self._code_pick - 1) % len(blocks)
        language, code = blocks[self._code_pick]
        self.app.copy_to_clipboard(code)
        kind = f" ({language})" if language else ""
        self.app.notify(f"Copied code block {self._code_pick + 1} of {len(blocks)}{kind}.")

    def compose(self) -> ComposeResult:
        yield Label(self.role_text(), classes="role")
        if self.reasoning.strip():  # a stored reply's thinking starts folded
            yield self._reasoning_block(collapsed=bool(self.raw.strip()))
        yield ReplyMarkdown(printable(self.raw), classes="body", parser_factory=markdown_parser)

    def _reasoning_block(self, collapsed: bool) -> Collapsible:
        """The thinking, dimmed and foldable. Only a reply with thinking has one: four
        widgets fewer to mount and lay out for every other message."""
        self._reasoning_text = Static(
            Text(printable(self.reasoning.strip())), classes="reasoning-text"
        )
        return Collapsible(
            self._reasoning_text, title="reasoning", collapsed=collapsed, classes="reasoning"
        )

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def append_reasoning(self, text: str) -> None:
        """Show more of the thinking (as text: never markup); its block appears with the
        first of it."""
        self.reasoning += text
        if not self.reasoning.strip():
            return
        if self._reasoning_text is not None:  # mounted, or on its way (chunks come fast)
            self._reasoning_text.update(Text(printable(self.reasoning.strip())))
        else:
            self.mount(self._reasoning_block(collapsed=False), before=self.markdown)

    def collapse_reasoning(self) -> None:
        """Fold the thinking (the answer is what is read now); a reply without any has
        nothing to fold."""
        for block in self.query(Collapsible):
            block.collapsed = True

    def append(self, text: str) -> str:
        """Record ``text`` and return its safe form for the Markdown stream."""
        self.raw += text
        return printable(text)


class Notice(Static):
    """A system notice inside the conversation (window moved, state restored…)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), classes="notice")


class ToolCallView(Static):
    """A call the model made and, once it came, what the tool returned: text, never markup
    or escapes (a long result shows its start; the model got it whole, up to the limit)."""

    SHOWN_RESULT_CHARS = 600

    def __init__(self, call: ToolCall) -> None:
        super().__init__(classes="tool-call")
        self.call = call
        self.result: str | None = None
        self.failed = False
        self.update(self._text())

    def show_result(self, text: str, failed: bool) -> None:
        self.result, self.failed = text, failed
        self.set_class(failed, "-failed")
        self.update(self._text())

    def _text(self) -> Text:
        arguments = json.dumps(self.call.arguments, ensure_ascii=False)
        text = Text(f"⚙ {self.call.name}({printable(arguments)})", style="bold")
        if self.result is None:
            text.append("\n  waiting…", style="dim")
            return text
        shown = self.result
        if len(shown) > self.SHOWN_RESULT_CHARS:
            shown = shown[: self.SHOWN_RESULT_CHARS] + f"… ({len(self.result):,} characters)"
        text.append(f"\n{'failed' if self.failed else 'returned'}: ", style="dim")
        text.append(printable(shown))
        return text
