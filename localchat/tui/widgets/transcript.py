"""The transcript: a conversation's messages as drawn, the turn under way added to them, what
the model no longer sees dimmed, and the notices a turn leaves.

What it draws comes as data (``TranscriptRow``, ``FinishedTurn``): read from the conversation
off the app's thread, where reading it touches the database (a message's branches)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from textual.containers import VerticalScroll
from textual.message import Message
from textual.reactive import var
from textual.widget import Widget

from localchat.chat.reasoning import split_reasoning
from localchat.chat.tools import ToolCall
from localchat.conversation.base import ConversationBase
from localchat.conversation.turn import FinishedTurn
from localchat.errors import LocalchatError
from localchat.paths import app_paths
from localchat.state.images import ImageStore
from localchat.tui.widgets.chat_message import (
    AssistantMessage,
    ChatEntry,
    Notice,
    ToolCallView,
    UserMessage,
    code_blocks,
)
from localchat.tui.widgets.image_view import ImageLine, stored_lines
from localchat.tui.widgets.reply_view import ReplyView

# A message's place in the window: (pinned, still seen by the model).
WindowMarks = Mapping[int, tuple[bool, bool]]


@dataclass(frozen=True)
class TranscriptRow:
    """A stored message as the transcript draws it."""

    message_id: int
    role: str
    content: str
    pinned: bool
    seen: bool  # the model still sees it (in the window, or pinned)
    branches: tuple[int, int] | None = None  # a question's (which, how many)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool result: the call it answers
    images: tuple[ImageLine, ...] = ()  # the images a question shows


def transcript_rows(conversation: ConversationBase) -> list[TranscriptRow]:
    """The branch in view, as rows (off the app's thread: a question's branches are read
    from the database, and the images' notes from the image store)."""
    rows = []
    store = ImageStore(app_paths().images_dir)
    for exchange in conversation.exchanges:
        record = exchange.record
        branches = conversation.branches_at(record.id) if record.role == "user" else None
        images = stored_lines(store, record.images) if record.images else ()
        rows.append(
            TranscriptRow(
                record.id,
                record.role,
                record.content,
                record.pinned,
                conversation.sees(record.id),
                branches,
                tuple(record.tool_calls),
                record.tool_call_id,
                images,
            )
        )
    return rows


def window_marks(conversation: ConversationBase) -> dict[int, tuple[bool, bool]]:
    """Each message's (pinned, seen) as the conversation holds them now (in memory)."""
    return {
        e.record.id: (e.record.pinned, conversation.sees(e.record.id))
        for e in conversation.exchanges
    }


def switch_branch(
    conversation: ConversationBase, message_id: int, step: int
) -> tuple[int, tuple[int, int], list[TranscriptRow]] | None:
    """Off the app's thread: the branch ``step`` places from a message's put in view; the
    message that starts it there, its place among the branches, and the rows to draw (None:
    no branch that way)."""
    target = conversation.switch_branch(message_id, step)
    if target is None:
        return None
    return target, conversation.branches_at(target), transcript_rows(conversation)


def branch_points(conversation: ConversationBase) -> list[int] | None:
    """Off the app's thread: the questions in view that have other branches (None: nothing
    is in view while other branches hold messages)."""
    if conversation.hidden_branches():
        return None
    return [
        e.record.id
        for e in conversation.exchanges
        if e.record.role == "user" and conversation.branches_at(e.record.id)[1] > 1
    ]


class Transcript(VerticalScroll):
    """The log of messages: the conversation it was last shown, and a message's keys that
    act on it (its branches, its pin). It owns the entries of the turn under way (the
    question and the reply being written) until the turn is stored."""

    # A turn is under way: the messages' keys wait (the screen binds its ``generating``).
    busy: var[bool] = var(False)

    @dataclass
    class BranchShown(Message):
        """Another branch is in view: the ``which``th of ``count`` at message ``place``."""

        which: int
        count: int
        place: int

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.conversation: ConversationBase | None = None
        self._question: UserMessage | None = None
        self._reply: ReplyView | None = None

    def place(self, message_id: int) -> int | None:
        """A message's number in the branch in view (1 is the first), if it is there."""
        if self.conversation is None:
            return None
        try:
            return self.conversation.index_of(message_id) + 1
        except LocalchatError:
            return None

    def _gone(self) -> bool:
        """The app went away (or this log) while a thread read the conversation."""
        return not self.is_mounted or not self.app.is_running

    async def show_conversation(self, conversation: ConversationBase | None) -> None:
        """Draw ``conversation``'s branch in view (its rows read off the app's thread); it is
        the one shown (``conversation``) once drawn."""
        rows = []
        if conversation is not None:
            rows = await asyncio.to_thread(transcript_rows, conversation)
        if not self._gone():
            await self.show(rows)
            self.conversation = conversation

    async def show(self, rows: Sequence[TranscriptRow]) -> None:
        """Draw a stored conversation (``rows``; none: an empty log)."""
        await self.remove_children()
        self._question = self._reply = None
        entries: list[Widget] = []
        calls: dict[str, ToolCallView] = {}
        for row in rows:
            entry: ChatEntry
            if row.role == "user":
                branch = row.branches or (1, 1)
                entry = UserMessage(row.content, row.message_id, branch, row.images)
            elif row.role == "assistant":
                thought, answer = split_reasoning(row.content)
                entry = AssistantMessage(answer, thought, row.message_id)
            elif row.role == "tool" and row.tool_call_id in calls:
                failed = row.content.startswith("error: ")
                calls[row.tool_call_id].show_result(row.content, failed)
                continue
            else:
                continue
            entry.show_window(row.pinned, row.seen)
            entries.append(entry)
            for call in row.tool_calls:
                calls[call.id] = ToolCallView(call)
                entries.append(calls[call.id])
        await self.mount_all(entries)
        self.scroll_end(animate=False)

    def show_window(self, marks: WindowMarks) -> None:
        """Mark what the model still sees (the window moved, a pin changed)."""
        for entry in self.query(ChatEntry):
            mark = marks.get(entry.message_id) if entry.message_id is not None else None
            if mark is not None:
                entry.show_window(*mark)

    async def add_turn(self, question: str | None, images: tuple[ImageLine, ...] = ()) -> ReplyView:
        """The turn under way: the question (None: a reply that reads tool results), with
        the ``images`` it shows, and the reply to be written, drawn at the end; the view
        stays there as it grows."""
        self._reply = ReplyView()
        self._question = None if question is None else UserMessage(question, images=images)
        await self.mount_all([e for e in (self._question, self._reply) if e is not None])
        self.anchor()
        return self._reply

    def turn_stored(self, turn: FinishedTurn) -> None:
        """The turn is stored: its entries take their ids (their keys act on them now), and
        the question its place among its branches (an edit makes a second)."""
        if self._question is not None:
            self._question.message_id = turn.user_id
            if turn.user_branches is not None:
                self._question.show_branch(turn.user_branches)
        if self._reply is not None and turn.reply_id is not None:
            self._reply.message_id = turn.reply_id
        self._question = self._reply = None

    async def take_back_turn(self) -> None:
        """The turn could not run: its entries go."""
        for view in (self._question, self._reply):
            if view is not None:
                await view.remove()
        self._question = self._reply = None

    async def add_notice(self, text: str) -> None:
        await self.mount(Notice(text))

    async def add_call(self, call: ToolCall) -> ToolCallView:
        """A call the reply made, drawn as it waits to run (its result shown on it later)."""
        view = ToolCallView(call)
        await self.mount(view)
        self.anchor()
        return view

    def select(self, message_id: int | None = None) -> None:
        """Give a message the focus (None: the last one) and bring it into view."""
        entries = list(self.query(ChatEntry))
        if message_id is not None:
            entries = [e for e in entries if e.message_id == message_id]
        if entries:
            entries[-1].focus()
            entries[-1].scroll_visible(animate=False)

    def copy_last_reply(self) -> None:
        replies = list(self.query(AssistantMessage))
        if not replies:
            self.notify("No reply to copy yet.")
            return
        self.app.copy_to_clipboard(replies[-1].raw)
        self.notify("Copied the last reply.")

    def copy_last_code(self) -> None:
        """Copy the last code block of the conversation."""
        replies = [r for r in self.query(AssistantMessage) if code_blocks(r.raw)]
        if not replies:
            self.notify("No code block in this conversation yet.")
            return
        language, code = code_blocks(replies[-1].raw)[-1]
        self.app.copy_to_clipboard(code)
        self.notify(f"Copied the last code block{f' ({language})' if language else ''}.")

    # -- a message's keys: its branches, its pin -----------------------------------------
    # Each change is keyed by the message's id and made off the event loop (on the compute
    # thread, between steps of reading ahead); so is every read of the branches.
    async def on_chat_entry_switch_branch(self, message: ChatEntry.SwitchBranch) -> None:
        message.stop()
        place = self.place(message.message_id)
        conversation = self.conversation
        if place is None or self.busy or conversation is None:
            return
        switched = await asyncio.to_thread(
            switch_branch, conversation, message.message_id, message.step
        )
        if switched is None:
            self.notify("No other branch that way.")
            return
        target, (which, count), rows = switched
        if self._gone():
            return
        await self.show(rows)
        self.select(target)
        self.post_message(self.BranchShown(which, count, place))

    async def on_chat_entry_pin(self, message: ChatEntry.Pin) -> None:
        message.stop()
        place = self.place(message.message_id)
        conversation = self.conversation
        if place is None or self.busy or conversation is None:
            return
        pinned = not conversation.exchanges[place - 1].record.pinned
        await asyncio.to_thread(conversation.pin, message.message_id, pinned)
        if not self._gone():
            self.show_window(window_marks(conversation))
        self.notify(
            f"Message {place} pinned: it stays in the context window."
            if pinned
            else f"Message {place} unpinned: it may leave the context window."
        )

    async def step_last_branch(self, step: int) -> None:
        """The previous or next branch at the last message that has several."""
        conversation = self.conversation
        if conversation is None:
            return
        forks = await asyncio.to_thread(branch_points, conversation)
        if forks is None:  # nothing in view, other branches hold messages
            await asyncio.to_thread(conversation.show_latest_branch)
            await self.show_conversation(conversation)
            return
        if not forks:
            self.notify("This conversation has no other branches yet.")
            return
        await self.on_chat_entry_switch_branch(ChatEntry.SwitchBranch(forks[-1], step))
