"""Acting on a message of the transcript: edit it (a new branch), switch its branches, pin
it in the context window, fork the conversation there. Each change is keyed by the
message's id and made off the event loop (on the compute thread, between steps of reading
ahead)."""

from __future__ import annotations

import asyncio

from localchat.errors import LocalchatError
from localchat.tui.chat.base import ChatScreenBase
from localchat.tui.widgets.chat_message import ChatEntry, UserMessage
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel


class BranchActions(ChatScreenBase):
    """The keys of a selected message, and the palette's branch commands."""

    def _place(self, message_id: int) -> int | None:
        """A message's number in the branch in view (1 is the first), if it is there."""
        conversation = self.conversation
        if conversation is None:
            return None
        try:
            return conversation.index_of(message_id) + 1
        except LocalchatError:
            return None

    def on_chat_entry_edit(self, message: ChatEntry.Edit) -> None:
        place = self._place(message.message_id)
        if place is None or self.generating or self.conversation is None:
            return
        box = self.query_one(PromptInput)
        if self.editing is None:  # what the box held comes back if the edit is cancelled
            self._box_before_edit = box.text
        self.editing = message.message_id
        box.text = self.conversation.exchanges[place - 1].record.content
        box.move_cursor(box.document.end)
        box.focus()
        self.notify(
            f"Editing message {place}: Enter sends it as a new branch (the old one is kept);"
            " Esc cancels."
        )

    async def on_chat_entry_switch_branch(self, message: ChatEntry.SwitchBranch) -> None:
        place = self._place(message.message_id)
        conversation = self.conversation
        if place is None or self.generating or conversation is None:
            return
        target = await asyncio.to_thread(
            conversation.switch_branch, message.message_id, message.step
        )
        if target is None:
            self.notify("No other branch that way.")
            return
        self.editing = None
        await self.show_transcript()
        for entry in self.query(UserMessage):
            if entry.message_id == target:
                entry.focus()
                entry.scroll_visible(animate=False)
        which, count = conversation.branches_at(target)
        self.query_one(StatsPanel).show_turn_start(f"branch {which} of {count} at message {place}")

    async def on_chat_entry_pin(self, message: ChatEntry.Pin) -> None:
        place = self._place(message.message_id)
        conversation = self.conversation
        if place is None or self.generating or conversation is None:
            return
        pinned = not conversation.exchanges[place - 1].record.pinned
        await asyncio.to_thread(conversation.pin, message.message_id, pinned)
        self.show_window()
        self.notify(
            f"Message {place} pinned: it stays in the context window."
            if pinned
            else f"Message {place} unpinned: it may leave the context window."
        )

    async def on_chat_entry_fork(self, message: ChatEntry.Fork) -> None:
        """``localchat branch`` in the app: the messages up to the selected one (a question:
        up to before it, and its text in the box to ask again) in a new conversation, whose
        first turn restores them from this one's saved cache."""
        place = self._place(message.message_id)
        conversation, session = self.conversation, self.session
        if place is None or self.generating or conversation is None or session is None:
            return
        record = conversation.exchanges[place - 1].record
        source = conversation.record.name
        try:  # its last state save is waited for and copied: off the event loop
            fork, at = await asyncio.to_thread(session.fork, message.message_id)
        except LocalchatError as exc:
            self.notify(str(exc), title="Could not fork", severity="error", timeout=15)
            return
        await self.open_conversation(fork.name)
        box = self.query_one(PromptInput)
        if record.role == "user":
            box.text = record.content
        box.focus()
        self.query_one(StatsPanel).show_turn_start(f"forked from {source} at message {at}")
        self.notify(f"Forked {source!r} at message {at} into {fork.name!r}.")

    def edit_last_question(self) -> None:
        conversation = self.conversation
        if conversation is None:
            return
        questions = [e.record.id for e in conversation.exchanges if e.record.role == "user"]
        if questions:
            self.on_chat_entry_edit(ChatEntry.Edit(questions[-1]))

    async def step_last_branch(self, step: int) -> None:
        """The previous or next branch at the last message that has several."""
        conversation = self.conversation
        if conversation is None:
            return
        if conversation.hidden_branches():
            await asyncio.to_thread(conversation.show_latest_branch)
            await self.show_transcript()
            return
        forks = [
            e.record.id
            for e in conversation.exchanges
            if e.record.role == "user" and conversation.branches_at(e.record.id)[1] > 1
        ]
        if not forks:
            self.notify("This conversation has no other branches yet.")
            return
        await self.on_chat_entry_switch_branch(ChatEntry.SwitchBranch(forks[-1], step))
