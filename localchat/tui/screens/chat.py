"""The chat screen: the transcript, the message box and the live figures; a conversation
opened, answered, branched and attached to (its areas in ``localchat.tui.chat``)."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from textual import work
from textual.binding import BindingType

from localchat.backends.compute_thread import run_compute
from localchat.conversation.base import ConversationBase
from localchat.errors import LocalchatError
from localchat.tui.bindings import CHAT_BINDINGS
from localchat.tui.chat.attachments import AttachmentActions
from localchat.tui.chat.branches import BranchActions
from localchat.tui.chat.turns import TurnStreaming
from localchat.tui.messages import ConversationRestored
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.widgets.chat_message import AssistantMessage, ChatEntry, Notice, code_blocks
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel
from localchat.units import count


class ChatScreen(TurnStreaming, BranchActions, AttachmentActions):
    """The app's first screen; dialogs open above it."""

    BINDINGS: ClassVar[list[BindingType]] = list(CHAT_BINDINGS)

    def on_mount(self) -> None:
        self.query_one(PromptInput).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Under a dialog the chat's keys neither act nor show in its footer (the dialog's
        own keys are the ones that work)."""
        return self.app.screen is self

    # -- opening and closing a conversation ----------------------------------------------
    async def open_conversation(self, name: str | None) -> None:
        """Open ``name`` (default: the most recent conversation, or a new one); the one open
        before closes first (its last state save waited for off the event loop)."""
        session = self.session
        if session is None:
            return
        await self.close_conversation()
        self.end_edit()  # an edit belongs to the conversation it began in
        # Opening reads the database and the model file's fingerprint: off the event loop.
        system_prompt = self.host.system_prompt
        try:
            conversation = await asyncio.to_thread(session.open_conversation, name, system_prompt)
        except LocalchatError as exc:
            self.notify(str(exc), severity="warning", timeout=15)
            conversation = await asyncio.to_thread(
                session.open_conversation, session.new_conversation_name()
            )
        if conversation is None:  # quitting, or nothing to open it on
            return
        if self.torn_down():  # the app went away while it opened
            await asyncio.to_thread(session.close_conversation)
            return
        conversation.on_save_error(lambda error: self.notify(error, severity="warning"))
        if self.host.settings.restore_on_open:
            self.restore_on_open(conversation)
        self.app.title = f"localchat — {conversation.record.title}"
        await self.show_transcript()
        if conversation.hidden_branches():
            await self.query_one("#log").mount(
                Notice(
                    "Nothing is written under this system prompt yet; the conversation's other"
                    " branches are kept (the palette's Previous branch brings the last one back)."
                )
            )
        self.read_ahead_box()

    async def close_conversation(self) -> None:
        """Close the open conversation; its last state save is waited for off the event loop."""
        self.reader.forget()
        session = self.session
        if session is not None and session.conversation is not None:
            await asyncio.to_thread(session.close_conversation)  # saves finish

    @work(thread=True, exit_on_error=False, group="restore")
    def restore_on_open(self, conversation: ConversationBase) -> None:
        """Its saved cache into memory now, on the compute thread (a turn sent meanwhile waits
        there for it), so the first turn after opening starts warm."""
        report = run_compute(conversation.restore_now)
        if report is not None and report.restored:  # the cache holds exactly the state's
            self.post_message(ConversationRestored(report.tokens, report.seconds))

    def on_conversation_restored(self, message: ConversationRestored) -> None:
        if self.generating or self.torn_down():
            return  # the turn's own figures are the news now, or the app is going away
        self.query_one(StatsPanel).show_turn_start(
            f"restored {count(message.tokens, 'token')} from saved cache in"
            f" {message.seconds:.2f} s: ready"
        )
        self.show_cache(message.tokens)

    # -- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.stop_turn()
        elif self.editing is not None:
            self.end_edit()
            self.notify("Edit cancelled; the conversation is as it was.")
        elif self.attachments:
            self.remove_attachments()

    def action_select_message(self) -> None:
        """Select the last message (its keys: edit, branches, copy)."""
        entries = list(self.query(ChatEntry))
        if entries:
            entries[-1].focus()
            entries[-1].scroll_visible(animate=False)

    async def action_new_chat(self) -> None:
        if self.generating or self.backend is None or self.session is None:
            return
        await self.open_conversation(self.session.new_conversation_name())
        self.query_one(StatsPanel).show_turn_start("new conversation")

    async def action_regenerate(self) -> None:
        conversation = self.conversation
        if self.generating or conversation is None:
            return
        self.end_edit()
        text = await asyncio.to_thread(conversation.take_back_last_exchange)
        if text is None:
            self.notify("Nothing to regenerate yet.")
            return
        await self.show_transcript()
        await self.start_turn(text)

    def action_system_prompt(self) -> None:
        conversation = self.conversation
        if conversation is None or self.generating:
            return

        async def save(text: str | None) -> None:
            if text is None or self.conversation is not conversation:
                return
            if (text or None) == conversation.record.system_prompt:
                return
            if not conversation.exchanges:
                await asyncio.to_thread(conversation.set_system_prompt, text)
                self.notify("System prompt saved.")
                return
            # Under another system prompt the conversation starts again, as a branch of its
            # own; the messages written under the old one stay on theirs.
            self.end_edit()
            await asyncio.to_thread(conversation.branch_system_prompt, text)
            await self.show_transcript()
            self.query_one(StatsPanel).show_turn_start("new system prompt: a new branch")
            self.notify(
                "System prompt saved as a new branch: the conversation starts again under it."
                " The old branch is kept (select its first message, then ←)."
            )

        current = conversation.record.system_prompt or ""
        hint = "Ctrl+S saves (a conversation under way goes on as a new branch) · Esc cancels"
        title = "System prompt for this conversation"
        self.app.push_screen(TextPromptScreen(title, current, hint), save)

    def action_copy_reply(self) -> None:
        replies = list(self.query(AssistantMessage))
        if not replies:
            self.notify("No reply to copy yet.")
            return
        self.app.copy_to_clipboard(replies[-1].raw)
        self.notify("Copied the last reply.")

    def action_copy_code(self) -> None:
        """Copy the last code block of the conversation."""
        replies = [r for r in self.query(AssistantMessage) if code_blocks(r.raw)]
        if not replies:
            self.notify("No code block in this conversation yet.")
            return
        language, code = code_blocks(replies[-1].raw)[-1]
        self.app.copy_to_clipboard(code)
        self.notify(f"Copied the last code block{f' ({language})' if language else ''}.")

    def action_conversations(self) -> None:
        session = self.session
        if session is None or session.store is None or session.states is None:
            return
        if self.generating:
            return
        current = self.conversation.record.name if self.conversation else None

        async def open_chosen(name: str | None) -> None:
            if name and self.backend is not None and name != current:
                await self.open_conversation(name)

        screen = ConversationsScreen(session.store, session.states, current)
        self.app.push_screen(screen, open_chosen)

    def quit_turn(self, wait_s: float) -> bool:
        """Quitting mid-reply: stop the model, and wait (bounded) for the turn to commit the
        partial reply; nothing more is read ahead. False if the turn did not end in time."""
        self.stop_turn()
        self.reader.stop()
        return self.turn_idle.wait(wait_s)
