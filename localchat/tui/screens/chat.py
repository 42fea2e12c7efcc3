"""The chat screen: the transcript, the composer and the live figures, and what coordinates
them: which conversation is open, the worker that runs a turn, the tool round between
replies, and the actions on a conversation and its messages.

Its areas own their state (``Transcript``, ``Composer``, ``ReplyView``, ``StatsPanel``); the
screen gathers from them and hands them data. Whatever reads the database runs off the
app's thread (``asyncio.to_thread``, or a thread worker posting a typed message)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import Footer, Header, TextArea

from localchat.backends.base import Backend, Sampling
from localchat.backends.compute_thread import run_compute
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall
from localchat.conversation.base import ConversationBase
from localchat.errors import LocalchatError
from localchat.tools.loop import ToolLoop
from localchat.tui.bindings import CHAT_BINDINGS
from localchat.tui.chat.tool_round import (
    AppToolHooks,
    PendingAnswer,
    ToolRounds,
    on_app_thread,
)
from localchat.tui.chat.turns import (
    ImageSources,
    TurnRequest,
    describe_turn_start,
    stream_turn,
    take_back_last,
)
from localchat.tui.messages import (
    ConversationRestored,
    ReadAhead,
    ReplyChunk,
    ReplyFailed,
    ReplyFinished,
)
from localchat.tui.screens.chat_files import AttachesFiles
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.screens.tool_consent import ToolConsentScreen
from localchat.tui.state import AppState
from localchat.tui.widgets.chat_message import ChatEntry
from localchat.tui.widgets.composer import Composer
from localchat.tui.widgets.image_view import AttachedImage, ImageLine
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.reply_view import ReplyView
from localchat.tui.widgets.stats_panel import StatsPanel
from localchat.tui.widgets.transcript import Transcript, window_marks
from localchat.tui.worker_failures import ReportsWorkerFailures
from localchat.units import count

if TYPE_CHECKING:  # the session (llama.cpp, the hub client) is imported after the first frame
    from localchat.session import Session

DEFAULT_MAX_TOKENS = 512


class ChatScreen(Screen[None], ReportsWorkerFailures, AttachesFiles):
    """The app's first screen; dialogs open above it."""

    BINDINGS: ClassVar[list[BindingType]] = list(CHAT_BINDINGS)

    # A turn (or its tool round) is under way; the transcript's keys wait meanwhile.
    generating = var(False)

    def __init__(self, state: AppState) -> None:
        super().__init__()
        self.state = state  # the app's: its session, settings and options
        self.transcript = Transcript(id="log")
        self.composer = Composer()
        self.panel = StatsPanel()
        self._cancel = threading.Event()  # set: the reply being written stops
        # Set while no turn runs: quitting waits on it, so a reply being written is committed.
        self.turn_idle = threading.Event()
        self.turn_idle.set()
        self._reply: ReplyView | None = None  # the reply being streamed
        self.tools = ToolRounds()
        self._consent_answer = PendingAnswer(self._cancel)

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield self.transcript.data_bind(busy=ChatScreen.generating)
                yield self.composer
            yield self.panel
        yield Footer()

    def on_mount(self) -> None:
        self.composer.focus_box()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Under a dialog the chat's keys neither act nor show in its footer (the dialog's
        own keys are the ones that work)."""
        return self.app.screen is self

    # -- what the app holds --------------------------------------------------------------
    @property
    def session(self) -> Session | None:
        return self.state.session

    @property
    def backend(self) -> Backend | None:
        session = self.state.session
        return None if session is None else session.backend

    @property
    def conversation(self) -> ConversationBase | None:
        session = self.state.session
        return None if session is None else session.conversation

    @property
    def max_tokens(self) -> int:
        return self.state.max_tokens or DEFAULT_MAX_TOKENS

    def _images_dir(self) -> Path | None:
        return None if self.session is None else self.session.paths.images_dir

    def torn_down(self) -> bool:
        """Whether the app began to quit (this screen may be gone) while a thread worked."""
        if self.state.quitting or not self.app.is_running:
            return True
        return not self.is_mounted or not self.transcript.is_mounted

    def show_cache(self, tokens: int, server_usage: float | None = None) -> None:
        if self.backend is not None:
            self.panel.show_cache(self.backend.cache_view(tokens, server_usage))

    # -- opening and closing a conversation ----------------------------------------------
    async def open_conversation(self, name: str | None) -> None:
        """Open ``name`` (default: the most recent conversation, or a new one); the one open
        before closes first (its last state save waited for off the event loop)."""
        session = self.session
        if session is None:
            return
        await self.close_conversation()
        self.composer.end_edit()  # an edit belongs to the conversation it began in
        # Opening reads the database and the model file's fingerprint: off the event loop.
        try:
            conversation = await asyncio.to_thread(
                session.open_conversation, name, self.state.system_prompt
            )
        except LocalchatError as exc:
            self.notify(str(exc), severity="warning", timeout=15)
            conversation = await asyncio.to_thread(
                lambda: session.open_conversation(session.new_conversation_name())
            )
        if conversation is None:  # quitting, or nothing to open it on
            return
        if self.torn_down():  # the app went away while it opened
            await asyncio.to_thread(session.close_conversation)
            return
        conversation.on_save_error(lambda error: self.notify(error, severity="warning"))
        if self.state.settings.restore_on_open:
            self.restore_on_open(conversation)
        self.app.title = f"localchat — {conversation.record.title}"
        await self.show_transcript()
        if await asyncio.to_thread(conversation.hidden_branches):
            await self.transcript.add_notice(
                "Nothing is written under this system prompt yet; the conversation's other"
                " branches are kept (the palette's Previous branch brings the last one back)."
            )
        self.read_ahead_box()

    async def close_conversation(self) -> None:
        """Close the open conversation; its last state save is waited for off the event loop."""
        self.composer.reader.forget()
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
        self.panel.show_turn_start(
            f"restored {count(message.tokens, 'token')} from saved cache in"
            f" {message.seconds:.2f} s: ready"
        )
        self.show_cache(message.tokens)

    # -- the transcript ------------------------------------------------------------------
    async def show_transcript(self) -> None:
        """Draw the open conversation (its rows read off the app's thread)."""
        if not self.torn_down():
            await self.transcript.show_conversation(self.conversation)

    def show_window(self) -> None:
        """Mark what the model still sees (the window moved, a pin changed)."""
        conversation = self.conversation
        if conversation is not None and not self.torn_down():
            self.transcript.show_window(window_marks(conversation))

    # -- reading the message box ahead ---------------------------------------------------
    @on(TextArea.Changed, "#input")
    def _draft_changed(self, event: TextArea.Changed) -> None:
        """The message being typed is read ahead in the background (setting type_ahead)."""
        self._read_ahead()

    def _read_ahead(self) -> None:
        conversation = self.conversation
        if self.state.settings.type_ahead and conversation is not None:
            self.composer.read_ahead(conversation, self.max_tokens)

    def read_ahead_box(self) -> None:
        """Read what the box holds ahead (after a turn, on opening a conversation): the
        conversation it was read for may have changed under it."""
        if not self.torn_down() and self.composer.has_draft():
            self._read_ahead()

    def on_read_ahead(self, message: ReadAhead) -> None:
        conversation = self.conversation
        current = conversation is not None and conversation.record.id == message.conversation_id
        if self.generating or self.torn_down() or not message.tokens or not current:
            return
        self.panel.show_turn_start(f"read {count(message.tokens, 'token')} ahead as you type")
        self.show_cache(message.kv_tokens)

    # -- a turn: sent, streamed, finished ------------------------------------------------
    @on(PromptInput.Submitted)
    async def send(self, message: PromptInput.Submitted) -> None:
        conversation = self.conversation
        if conversation is None:
            self.notify("No model is loaded yet; your message is kept.", severity="warning")
            return
        if self.generating:
            self.notify("Still answering; press Esc to stop first.", severity="warning")
            return
        entered_at = time.perf_counter()
        edited = self.composer.take_edit()
        if edited is not None:  # in place of an earlier message: a new branch
            try:
                await asyncio.to_thread(conversation.branch_before, edited)
            except LocalchatError:
                self.notify("That message is no longer in view; your text is kept.")
                return
            await self.show_transcript()
        text, images = self.composer.take_message(message.text)
        await self.start_turn(text, entered_at, images)

    async def start_turn(
        self, text: str, entered_at: float | None = None, images: tuple[AttachedImage, ...] = ()
    ) -> None:
        """``entered_at``: when the user sent it (the first-token figure counts from there);
        ``images``: what it shows (stored by the turn's worker, where the model reads them)."""
        entered_at = time.perf_counter() if entered_at is None else entered_at
        conversation = self.conversation
        assert conversation is not None
        await self._open_reply(text, tuple(i.line for i in images))
        self.composer.steady(True)
        self._cancel.clear()
        sources = tuple(i.source for i in images)
        self._after_layout(self._begin_generation, conversation, text, entered_at, None, sources)

    async def start_results_turn(self, results: list[ChatMessage]) -> None:
        """The reply that reads the results of the last reply's calls (the cache holds the
        rest: only the results and the cue are evaluated)."""
        conversation = self.conversation
        assert conversation is not None
        await self._open_reply(None)
        self._after_layout(self._begin_generation, conversation, "", time.perf_counter(), results)

    async def _open_reply(self, question: str | None, images: tuple[ImageLine, ...] = ()) -> None:
        self._reply = await self.transcript.add_turn(question, images)
        self._reply.open_stream()
        self.turn_idle.clear()
        self.generating = True

    def _after_layout(self, callback: Callable[..., None], *args: object) -> None:
        """Run ``callback`` once the new messages are drawn: their first layout sizes them
        and the sizes ask for a second, so it waits for two refreshes. (Those frames do not
        then compete with generation for the cores.)"""
        self.call_after_refresh(self.call_after_refresh, callback, *args)

    def _begin_generation(
        self,
        conversation: ConversationBase,
        text: str,
        entered_at: float,
        results: list[ChatMessage] | None,
        images: ImageSources = (),
    ) -> None:
        if self._reply is not None:  # the drawing budget: a share of what generating costs
            self._reply.pace(self.backend.threads if self.backend is not None else 1)
        sampling = self.state.sampling or Sampling()
        request = TurnRequest(
            conversation, text, entered_at, sampling, self.max_tokens, results, images
        )
        self.generate(self.session, replace(request, images_dir=self._images_dir()))

    def stop_turn(self) -> None:
        """Stop the reply being written (the turn commits what was written), or the tool
        round under way (a dialog waiting for consent is answered "deny")."""
        self._cancel.set()
        self._consent_answer.deny()

    @work(thread=True, exit_on_error=False, exclusive=True, group="generate")
    def generate(self, session: Session | None, request: TurnRequest) -> None:
        """The turn, on the compute thread (``stream_turn`` posts what it writes)."""
        try:
            stats = run_compute(
                stream_turn, request, self._cancel, self.post_message, self._generation_failed
            )
        finally:
            self.turn_idle.set()
        if session is not None and session.backend is not None and stats is not None:
            from localchat.models.speed_feedback import note_turn_speed

            # Real turns correct the calibration.
            corrected = note_turn_speed(session.paths, session.backend, stats)
            if corrected:
                self.notify(corrected, title="Speed figures", timeout=10)

    def _generation_failed(self, error: str) -> None:
        self.notify(error, severity="error", timeout=15)

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        reply = self._reply
        if reply is None:
            return
        # The speed and cache lines change less often than the reply is drawn.
        if await reply.take(message.text, message.reasoning) and self.panel.live_due():
            self.panel.show_speed(message.stats, message.ttft_s)
            self.show_cache(message.kv_tokens)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        if self.torn_down():  # quitting: the turn committed the reply; nothing to draw
            self.generating = False
            return
        # The last text, the figures and the ids land in one layout of the screen, not one
        # each (a layout and repaint of the chat costs its thread ~15 ms).
        with self.app.batch_update():
            await self._finish_turn(message)

    async def _finish_turn(self, message: ReplyFinished) -> None:
        turn = message.turn
        reply, self._reply = self._reply, None
        if reply is not None:
            await reply.finish()
        self.composer.steady(False)
        self.transcript.turn_stored(turn)
        if turn.window.dropped_messages:
            self.show_window()
        stats = turn.stats
        self.panel.show_speed(stats, turn.sent_ttft_s, final=True)
        self.panel.show_turn_start(describe_turn_start(turn))
        self.show_cache(message.kv_tokens, stats.server_kv_usage)
        for notice in turn.notices:
            await self.transcript.add_notice(notice)
        if stats.stop_reason == "cancelled":
            await self.transcript.add_notice("stopped — the partial reply is kept")
        conversation = self.conversation
        if turn.tool_calls and conversation is not None and stats.stop_reason != "cancelled":
            self._start_tool_round(conversation, list(turn.tool_calls))
            return  # still answering: the calls run, then the reply reads their results
        self.tools.reset()
        self.generating = False
        self.read_ahead_box()  # typed while the reply was written

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        reply, self._reply = self._reply, None
        if reply is not None:
            await reply.close_stream()
        self.composer.steady(False)
        await self.transcript.take_back_turn()
        self.composer.give_back(message.user_text)  # the files wait for the next try
        self.notify(message.error, title="Could not send", severity="error", timeout=15)
        self.generating = False

    def quit_turn(self, wait_s: float) -> bool:
        """Quitting mid-reply: stop the model, and wait (bounded) for the turn to commit the
        partial reply; nothing more is read ahead. False if the turn did not end in time."""
        self.stop_turn()
        self.composer.reader.stop()
        return self.turn_idle.wait(wait_s)

    # -- the tool round (the runtime's loop; the app's hooks: tui.chat.tool_round) -----
    def _start_tool_round(self, conversation: ConversationBase, calls: list[ToolCall]) -> None:
        if self.tools.loop is None:  # the first calls since the user's message
            consent = self.tools.consent(conversation.record.id)
            hooks = AppToolHooks(
                self.app,
                consent,
                self.transcript.add_call,
                lambda call, server, done: self.app.push_screen(
                    ToolConsentScreen(call, server), done
                ),
                self.session,
                self._cancel,
                self.torn_down,
                self._consent_answer,
            )
            self.tools.loop = ToolLoop(hooks, self._cancel)
        self.turn_idle.clear()  # quitting waits for the round to answer its calls
        self._tool_round(conversation, self.tools.loop, calls)

    @work(thread=True, exit_on_error=False, exclusive=True, group="tools")
    def _tool_round(
        self, conversation: ConversationBase, loop: ToolLoop, calls: list[ToolCall]
    ) -> None:
        """One round of the loop, then the reply that reads its results. However it ends
        (stopped, failed, the app quitting), every call is answered."""
        started = False
        try:
            answer = loop.answer(calls)
            if answer.go_on and not self.torn_down() and conversation is self.conversation:
                with contextlib.suppress(RuntimeError):  # the app quit meanwhile
                    on_app_thread(self.app, self.start_results_turn, answer.results)
                    started = True  # its worker says when it is idle
            if not started:
                with contextlib.suppress(Exception):  # quitting: the next send answers them
                    run_compute(conversation.record_results, answer.results)
                with contextlib.suppress(RuntimeError):
                    self.app.call_from_thread(self._tool_rounds_ended)
            if answer.error is not None:
                raise answer.error
        finally:
            if not started:
                self.turn_idle.set()

    def _tool_rounds_ended(self) -> None:
        self.tools.reset()
        self.generating = False

    # -- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.stop_turn()
        elif self.composer.editing is not None:
            self.composer.end_edit()
            self.notify("Edit cancelled; the conversation is as it was.")
        elif self.composer.has_attachments:
            self.drop_attachments()  # the words in the box stay

    def action_select_message(self) -> None:
        """Select the last message (its keys: edit, branches, copy)."""
        self.transcript.select()

    async def action_new_chat(self) -> None:
        session = self.session
        if self.generating or self.backend is None or session is None:
            return
        # A free name is looked up in the database: off the event loop.
        name = await asyncio.to_thread(session.new_conversation_name)
        if self.generating:  # a message sent meanwhile: its conversation stays open
            return
        await self.open_conversation(name)
        self.panel.show_turn_start("new conversation")

    async def action_regenerate(self) -> None:
        conversation = self.conversation
        if self.generating or conversation is None:
            return
        self.composer.end_edit()
        taken = await asyncio.to_thread(take_back_last, conversation, self._images_dir())
        if taken is None:
            self.notify("Nothing to regenerate yet.")
            return
        await self.show_transcript()
        await self.start_turn(*taken)

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
            self.composer.end_edit()
            await asyncio.to_thread(conversation.branch_system_prompt, text)
            await self.show_transcript()
            self.panel.show_turn_start("new system prompt: a new branch")
            self.notify(
                "System prompt saved as a new branch: the conversation starts again under it."
                " The old branch is kept (select its first message, then ←)."
            )

        current = conversation.record.system_prompt or ""
        hint = "Ctrl+S saves (a conversation under way goes on as a new branch) · Esc cancels"
        title = "System prompt for this conversation"
        self.app.push_screen(TextPromptScreen(title, current, hint), save)

    def action_copy_reply(self) -> None:
        self.transcript.copy_last_reply()

    def action_copy_code(self) -> None:
        """Copy the last code block of the conversation."""
        self.transcript.copy_last_code()

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

    # -- a message's keys: edit, fork (its branches and pin: the transcript's) -----------
    async def on_chat_entry_edit(self, message: ChatEntry.Edit) -> None:
        place = self.transcript.place(message.message_id)
        conversation = self.conversation
        if place is None or self.generating or conversation is None:
            return
        record = conversation.exchanges[place - 1].record
        images = await self.attached_images(record.images)  # the edit shows them again
        self.composer.begin_edit(message.message_id, record.content, images)
        self.notify(
            f"Editing message {place}: Enter sends it as a new branch (the old one is kept);"
            " Esc cancels."
        )

    def on_transcript_branch_shown(self, message: Transcript.BranchShown) -> None:
        self.composer.take_edit()  # an edit is dropped (the box keeps what it holds)
        self.panel.show_turn_start(
            f"branch {message.which} of {message.count} at message {message.place}"
        )

    async def on_chat_entry_fork(self, message: ChatEntry.Fork) -> None:
        """``localchat branch`` in the app: the messages up to the selected one (a question:
        up to before it, and its text in the box to ask again) in a new conversation, whose
        first turn restores them from this one's saved cache."""
        place = self.transcript.place(message.message_id)
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
        if record.role == "user":
            self.composer.set_text(record.content)
        self.composer.focus_box()
        self.panel.show_turn_start(f"forked from {source} at message {at}")
        self.notify(f"Forked {source!r} at message {at} into {fork.name!r}.")

    def edit_last_question(self) -> None:
        conversation = self.conversation
        if conversation is None:
            return
        questions = [e.record.id for e in conversation.exchanges if e.record.role == "user"]
        if questions:
            self.run_worker(self.on_chat_entry_edit(ChatEntry.Edit(questions[-1])), group="edit")

    async def step_last_branch(self, step: int) -> None:
        """The previous or next branch at the last message that has several."""
        await self.transcript.step_last_branch(step)
