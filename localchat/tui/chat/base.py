"""What every part of the chat screen shares: its state, the transcript drawn from the
conversation, the stats panel's cache line, and reading the message box ahead.

The screen asks the session (through the app that holds it) and draws; blocking work runs in
thread workers that get what they need as arguments and answer with typed messages.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol, cast

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header, TextArea
from textual.widgets.markdown import MarkdownStream

from localchat.backends.base import Backend, Sampling
from localchat.chat.attachments import Attachment, with_attachments
from localchat.chat.reasoning import split_reasoning
from localchat.conversation.base import ConversationBase
from localchat.conversation.draft_reader import DraftReader
from localchat.settings import Settings
from localchat.tools.consent import Consent
from localchat.tui.messages import ReadAhead
from localchat.tui.pacing import FramePacer
from localchat.tui.widgets.chat_message import (
    AssistantMessage,
    ChatEntry,
    ToolCallView,
    UserMessage,
)
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel
from localchat.tui.worker_failures import ReportsWorkerFailures
from localchat.units import count

if TYPE_CHECKING:  # the session (llama.cpp, the hub client) is imported after the first frame
    from localchat.session import Session

DEFAULT_MAX_TOKENS = 512


class ChatHost(Protocol):
    """What the chat screen reads from the app that holds it."""

    session: Session | None
    settings: Settings
    sampling: Sampling | None
    max_tokens: int | None
    system_prompt: str | None
    quitting: bool


class ChatScreenBase(Screen[None], ReportsWorkerFailures):
    """The chat screen's state and the parts every area of it uses."""

    def __init__(self) -> None:
        super().__init__()
        self._cancel = threading.Event()
        # Set while no turn runs: quitting waits on it, so a reply being written is committed.
        self.turn_idle = threading.Event()
        self.turn_idle.set()
        self.generating = False
        self._reply: AssistantMessage | None = None
        self._user_view: UserMessage | None = None
        self._stream: MarkdownStream | None = None
        self._pacer: FramePacer | None = None
        self._undrawn = ""  # reply text received but not drawn yet (the pacer held it)
        self._stats_shown_at = 0.0
        # The message box's text, read ahead while it is typed (one worker at a time).
        self.reader = DraftReader()
        # The message being edited (its id): Enter sends the box's text in its place, as a
        # new branch.
        self.editing: int | None = None
        self._box_before_edit = ""
        # Files that go with the next message, and what the last one sent had (a failed
        # send gives both back).
        self.attachments: list[Attachment] = []
        self._attachment_tokens: list[int] = []  # what each costs, counted when it came
        self._sent: tuple[str, list[Attachment], list[int]] = ("", [], [])
        # Tools the user allowed for good, per conversation (by its id).
        self.tool_consents: dict[str, Consent] = {}
        self.tool_rounds = 0  # rounds of calls since the user's last message

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="log")
                yield PromptInput(id="input", placeholder="Message (Enter sends, Ctrl+J new line)")
            yield StatsPanel()
        yield Footer()

    # -- what the app holds --------------------------------------------------------------
    @property
    def host(self) -> ChatHost:
        return cast(ChatHost, self.app)

    @property
    def session(self) -> Session | None:
        return self.host.session

    @property
    def backend(self) -> Backend | None:
        session = self.host.session
        return None if session is None else session.backend

    @property
    def conversation(self) -> ConversationBase | None:
        session = self.host.session
        return None if session is None else session.conversation

    @property
    def max_tokens(self) -> int:
        return self.host.max_tokens or DEFAULT_MAX_TOKENS

    def torn_down(self) -> bool:
        """Whether the app began to quit (this screen may be gone) while a thread worked."""
        if self.host.quitting or not self.app.is_running:
            return True
        return not self.is_mounted or not self.query("#log")

    async def open_conversation(self, name: str | None) -> None:
        """Open ``name`` (default: the most recent conversation, or a new one)."""
        raise NotImplementedError  # the chat screen's

    # -- the transcript ------------------------------------------------------------------
    async def show_transcript(self) -> None:
        if self.torn_down():
            return
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        conversation = self.conversation
        if conversation is None:
            return
        entries: list[Widget] = []
        calls: dict[str, ToolCallView] = {}
        for exchange in conversation.exchanges:
            record = exchange.record
            entry: ChatEntry
            if record.role == "user":
                entry = UserMessage(record.content, record.id, conversation.branches_at(record.id))
            elif record.role == "assistant":
                thought, answer = split_reasoning(record.content)
                entry = AssistantMessage(answer, thought, record.id)
            elif record.role == "tool" and record.tool_call_id in calls:
                result = record.content
                calls[record.tool_call_id].show_result(result, result.startswith("error: "))
                continue
            else:
                continue
            entry.show_window(record.pinned, conversation.sees(record.id))
            entries.append(entry)
            for call in record.tool_calls:
                calls[call.id] = ToolCallView(call)
                entries.append(calls[call.id])
        await log.mount_all(entries)
        log.scroll_end(animate=False)

    def show_window(self) -> None:
        """Mark what the model still sees (the window moved, a pin changed)."""
        conversation = self.conversation
        if conversation is None or self.torn_down():
            return
        records = {e.record.id: e.record for e in conversation.exchanges}
        for entry in self.query(ChatEntry):
            record = records.get(entry.message_id) if entry.message_id is not None else None
            if record is not None:
                entry.show_window(record.pinned, conversation.sees(record.id))

    def show_cache(self, tokens: int, server_usage: float | None = None) -> None:
        if self.backend is not None:
            self.query_one(StatsPanel).show_cache(self.backend.cache_view(tokens, server_usage))

    def end_edit(self) -> None:
        """Stop editing: the box gets back what it held before the edit began."""
        if self.editing is not None:
            self.editing = None
            box = self.query_one(PromptInput)
            box.text = self._box_before_edit
            box.move_cursor(box.document.end)

    # -- reading the message box ahead ---------------------------------------------------
    @on(TextArea.Changed, "#input")
    def _draft_changed(self, event: TextArea.Changed) -> None:
        """The message being typed is read ahead in the background (setting type_ahead)."""
        self._schedule_read_ahead(event.text_area.text)

    def _schedule_read_ahead(self, text: str) -> None:
        conversation = self.conversation
        if not self.host.settings.type_ahead or conversation is None:
            return
        if self.editing is not None:  # it replaces an earlier message: read when sent
            return
        if self.reader.offer(conversation, with_attachments(text, self.attachments)):
            self.read_ahead(self.reader, self.max_tokens)

    def read_ahead_box(self) -> None:
        """Read what the box holds ahead (after a turn, on opening a conversation): the
        conversation it was read for may have changed under it."""
        if self.torn_down():
            return
        text = self.query_one(PromptInput).text
        if text.strip() or self.attachments:
            self._schedule_read_ahead(text)

    @work(thread=True, exit_on_error=False, group="read-ahead")
    def read_ahead(self, reader: DraftReader, max_tokens: int) -> None:
        """Read the box's newest text ahead until it is read (see ``DraftReader``)."""

        def report(conversation_id: str, tokens: int, kv_tokens: int) -> None:
            self.post_message(ReadAhead(conversation_id, tokens, kv_tokens))

        reader.run(max_tokens, report)

    def on_read_ahead(self, message: ReadAhead) -> None:
        conversation = self.conversation
        current = conversation is not None and conversation.record.id == message.conversation_id
        if self.generating or self.torn_down() or not message.tokens or not current:
            return
        self.query_one(StatsPanel).show_turn_start(
            f"read {count(message.tokens, 'token')} ahead as you type"
        )
        self.show_cache(message.kv_tokens)
