"""A turn on the chat screen: Enter → the user's message drawn → the reply streamed in at a
pace the machine can afford → the figures and the stored ids when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from textual import on, work
from textual.containers import VerticalScroll
from textual.widgets import Markdown

from localchat.backends.base import Sampling, TurnStats
from localchat.backends.compute_thread import run_compute
from localchat.chat.attachments import with_attachments
from localchat.chat.template import ChatMessage, results_saying
from localchat.chat.tools import ToolCall
from localchat.conversation.base import NOT_RUN, ConversationBase
from localchat.conversation.turn import ConversationTurn, FinishedTurn
from localchat.errors import LocalchatError
from localchat.tools.consent import DENIED_RESULT, MAX_ROUNDS, STOPPED, STOPPED_RESULT, Consent
from localchat.tools.results import ToolResult, failure
from localchat.tui.chat.base import ChatScreenBase
from localchat.tui.messages import ReplyChunk, ReplyFailed, ReplyFinished
from localchat.tui.pacing import MIN_INTERVAL_S, FramePacer
from localchat.tui.screens.tool_consent import ToolConsentScreen
from localchat.tui.widgets.chat_message import AssistantMessage, Notice, ToolCallView, UserMessage
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel
from localchat.units import count

if TYPE_CHECKING:
    from localchat.session import Session

# The worker posts text at most this often; the pacer decides which chunks get drawn at once.
# The stats panel's speed and cache lines change less often still.
CHUNK_INTERVAL_S = MIN_INTERVAL_S
STATS_INTERVAL_S = 0.5


class TurnStreaming(ChatScreenBase):
    """Sending a message and drawing its reply as it streams."""

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
        if self.editing is not None:  # in place of an earlier message: a new branch
            edited, self.editing = self.editing, None
            try:
                await asyncio.to_thread(conversation.branch_before, edited)
            except LocalchatError:
                self.notify("That message is no longer in view; your text is kept.")
                return
            await self.show_transcript()
        self._sent = (message.text, self.attachments, self._attachment_tokens)
        text = with_attachments(message.text, self.attachments)
        self.attachments, self._attachment_tokens = [], []
        self.query_one(PromptInput).clear()
        await self.start_turn(text, entered_at)

    async def start_turn(self, text: str, entered_at: float | None = None) -> None:
        """``entered_at``: when the user sent it (the first-token figure counts from there)."""
        entered_at = time.perf_counter() if entered_at is None else entered_at
        assert self.conversation is not None
        log = self.query_one("#log", VerticalScroll)
        self._reply = AssistantMessage()
        self._user_view = UserMessage(text)
        await log.mount_all([self._user_view, self._reply])
        log.anchor()
        self._stream = Markdown.get_stream(self._reply.markdown)
        self._undrawn = ""
        # A steady cursor while the model answers: each blink is a repaint taken from generation.
        self.query_one(PromptInput).cursor_blink = False
        self._cancel.clear()
        self.turn_idle.clear()
        self.generating = True
        self._after_layout(self._begin_generation, self.conversation, text, entered_at)

    async def start_results_turn(self, results: list[ChatMessage]) -> None:
        """The reply that reads the results of the last reply's calls (the cache holds the
        rest: only the results and the cue are evaluated)."""
        assert self.conversation is not None
        log = self.query_one("#log", VerticalScroll)
        self._reply = AssistantMessage()
        self._user_view = None
        await log.mount(self._reply)
        log.anchor()
        self._stream = Markdown.get_stream(self._reply.markdown)
        self._undrawn = ""
        self.turn_idle.clear()
        self.generating = True
        self._after_layout(
            self._begin_generation, self.conversation, "", time.perf_counter(), results
        )

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
        results: list[ChatMessage] | None = None,
    ) -> None:
        # The app's drawing budget is a share of what generating costs this machine.
        self._pacer = FramePacer(self.backend.threads if self.backend is not None else 1)
        sampling = self.host.sampling or Sampling()
        self.generate(
            self.session, conversation, text, entered_at, sampling, self.max_tokens, results
        )

    def stop_turn(self) -> None:
        """Stop the reply being written (the turn commits what was written)."""
        self._cancel.set()

    # -- the worker (a thread; the turn itself on the compute thread) --------------------
    @work(thread=True, exit_on_error=False, exclusive=True, group="generate")
    def generate(
        self,
        session: Session | None,
        conversation: ConversationBase,
        text: str,
        entered_at: float,
        sampling: Sampling,
        max_tokens: int,
        results: list[ChatMessage] | None = None,
    ) -> None:
        try:
            stats = run_compute(
                self._stream_turn, conversation, text, entered_at, sampling, max_tokens, results
            )
        finally:
            self.turn_idle.set()
        if session is not None and stats is not None:  # real turns correct the calibration
            corrected = session.note_turn_speed(stats)
            if corrected:
                self.notify(corrected, title="Speed figures", timeout=10)

    def _stream_turn(
        self,
        conversation: ConversationBase,
        text: str,
        entered_at: float,
        sampling: Sampling,
        max_tokens: int,
        results: list[ChatMessage] | None = None,
    ) -> TurnStats | None:
        """One turn, on the compute thread: posts the reply as it comes, in chunks; its
        figures at the end (None: it never started). ``results``: the turn reads the last
        reply's call results (``text`` is then empty)."""
        cancel = self._cancel
        try:
            if results is not None:
                turn = conversation.send_results(results, sampling, max_tokens, cancel)
            else:
                turn = conversation.send(text, sampling, max_tokens, cancel, entered_at=entered_at)
        except LocalchatError as exc:
            self.post_message(ReplyFailed(str(exc), text))
            return None
        except Exception as exc:  # the app stays up whatever the runtime raises
            self.post_message(ReplyFailed(f"unexpected error: {exc}", text))
            return None
        pending = thinking = ""
        last_post = time.perf_counter()
        try:
            for delta in turn:
                if delta.reasoning:
                    thinking += delta.text
                else:
                    pending += delta.text
                now = time.perf_counter()
                if now - last_post >= CHUNK_INTERVAL_S:
                    self._post_chunk(conversation, turn, pending, thinking)
                    pending = thinking = ""
                    last_post = now
        except Exception as exc:
            self.notify(f"generation failed: {exc}", severity="error", timeout=15)
        if pending or thinking:
            self._post_chunk(conversation, turn, pending, thinking)
        try:  # here, not on the app's thread: it reads the database
            finished = turn.finished(branches=results is None)
        except Exception:  # the store failed under it: the reply is drawn, its branches not
            finished = turn.finished(branches=False)
        self.post_message(ReplyFinished(finished, conversation.context_tokens(turn)))
        return finished.stats

    def _post_chunk(
        self, conversation: ConversationBase, turn: ConversationTurn, text: str, thinking: str
    ) -> None:
        kv_tokens = conversation.context_tokens(turn)
        stats = replace(turn.stats)
        self.post_message(ReplyChunk(text, stats, kv_tokens, thinking, turn.sent_ttft_s))

    # -- drawing it (the screen's thread) ------------------------------------------------
    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        if self._reply is None:
            return
        if message.reasoning:
            self._reply.append_reasoning(message.reasoning)
        self._undrawn += self._reply.append(message.text)
        if self._pacer is not None and self._pacer.frame_due():
            await self._draw_reply()
            now = time.perf_counter()
            if now - self._stats_shown_at >= STATS_INTERVAL_S:
                self._stats_shown_at = now
                self.query_one(StatsPanel).show_speed(message.stats, message.ttft_s)
                self.show_cache(message.kv_tokens)

    async def _draw_reply(self) -> None:
        """Hand the text the pacer held back to the Markdown stream (one frame)."""
        if self._stream is not None and self._undrawn:
            await self._stream.write(self._undrawn)
        self._undrawn = ""

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        if self.torn_down():  # quitting: the turn committed the reply; nothing to draw
            self.generating = False
            return
        # The last text, the figures and the ids land in one layout of the screen, not one
        # each (a layout and repaint of the chat costs its thread ~15 ms).
        with self.app.batch_update():
            await self._finish_turn(message)

    async def _finish_turn(self, message: ReplyFinished) -> None:
        await self._draw_reply()
        await self._end_stream()
        conversation = self.conversation
        turn = message.turn
        if self._user_view is not None and conversation is not None:  # stored: keys act on it
            self._user_view.message_id = turn.user_id
            if turn.user_branches is not None:  # in view: its branches (an edit)
                self._user_view.show_branch(turn.user_branches)
        if self._reply is not None and turn.reply_id is not None:
            self._reply.message_id = turn.reply_id
        if turn.window.dropped_messages:
            self.show_window()
        if self._reply is not None and self._reply.raw.strip():
            self._reply.collapse_reasoning()  # the answer is what is read now
        stats = message.stats
        panel = self.query_one(StatsPanel)
        panel.show_speed(stats, turn.sent_ttft_s, final=True)
        panel.show_turn_start(describe_turn_start(turn))
        self.show_cache(message.kv_tokens, stats.server_kv_usage)
        log = self.query_one("#log", VerticalScroll)
        for notice in turn.notices:
            await log.mount(Notice(notice))
        if stats.stop_reason == "cancelled":
            await log.mount(Notice("stopped — the partial reply is kept"))
        calls = list(turn.tool_calls)
        if calls and conversation is not None and stats.stop_reason != "cancelled":
            self.tool_rounds += 1
            self.run_worker(
                self._tool_round(conversation, calls),
                group="tools",
                exclusive=True,
                exit_on_error=False,
            )
            return  # still answering: the calls run, then the reply reads their results
        self.tool_rounds = 0
        self.generating = False
        self.read_ahead_box()  # typed while the reply was written

    async def _tool_round(self, conversation: ConversationBase, calls: list[ToolCall]) -> None:
        """Each call shown and run where the user allows it (asked unless allowed for this
        conversation); a denied call's result tells the model so. Then the reply reads them.
        However the round ends (stopped, failed, the app quitting), the calls it did not
        answer are answered as not run."""
        results: list[ChatMessage] = []
        go_on = False
        try:
            if self.tool_rounds > MAX_ROUNDS:
                results = results_saying(calls, STOPPED_RESULT)
                self.notify(STOPPED, title="Tools")
                return
            await self._run_calls(conversation, calls, results)
            go_on = not (
                self._cancel.is_set() or self.torn_down() or conversation is not self.conversation
            )
        finally:
            answered = {m.tool_call_id for m in results}
            results += results_saying([c for c in calls if c.id not in answered], NOT_RUN)
            if go_on:
                await self.start_results_turn(results)
            else:
                self.tool_rounds = 0
                self.generating = False
                with contextlib.suppress(Exception):  # quitting: the next send answers them
                    await asyncio.to_thread(run_compute, conversation.record_results, results)

    async def _run_calls(
        self, conversation: ConversationBase, calls: list[ToolCall], results: list[ChatMessage]
    ) -> None:
        session = self.session
        consent = self.tool_consents.setdefault(conversation.record.id, Consent())
        log = self.query_one("#log", VerticalScroll)
        for call in calls:
            view = ToolCallView(call)
            await log.mount(view)
            log.anchor()
            allowed = consent.allows(call)
            if not allowed and not self._cancel.is_set():
                server = session.tools.server_of(call.name) if session and session.tools else None
                choice = await self.app.push_screen_wait(ToolConsentScreen(call, server))
                allowed = consent.answer(call, choice)
            if self._cancel.is_set():
                result = failure("the user stopped the reply")
            elif allowed and session is not None:
                result = await asyncio.to_thread(session.run_tool, call, self._cancel)
            else:
                result = ToolResult(DENIED_RESULT, is_error=True)
            view.show_result(result.text, result.is_error)
            results.append(ChatMessage("tool", result.text, tool_call_id=call.id))

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        await self._end_stream()
        for view in (self._user_view, self._reply):
            if view is not None:
                await view.remove()
        prompt = self.query_one(PromptInput)
        typed, attachments, tokens = self._sent
        if attachments and message.user_text == with_attachments(typed, attachments):
            # The files wait for the next try, apart from the words in the box.
            self.attachments, self._attachment_tokens = attachments, tokens
            restored_text = typed
        else:
            restored_text = message.user_text
        if not prompt.text.strip():
            prompt.text = restored_text
        self.notify(message.error, title="Could not send", severity="error", timeout=15)
        self.generating = False

    async def _end_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._pacer = None
        self._undrawn = ""
        self.query_one(PromptInput).cursor_blink = True


def describe_turn_start(turn: FinishedTurn) -> str:
    """How the turn began: restored from disk, reused from memory, or evaluated."""
    stats = turn.stats
    restore = turn.restore
    if stats.kv_bytes_used is None:  # a server: it reads the prompt, reusing its own cache
        about = "" if stats.counted == "server" else "≈"
        return (
            f"sent {about}{count(stats.prompt_tokens, 'token')}; the server answered in"
            f" {stats.ttft_s:.2f} s"
        )
    evaluated = f"evaluated {count(stats.prompt_tokens_evaluated, 'token')} in {stats.ttft_s:.2f} s"
    if restore.read_ahead:
        ahead = count(restore.read_ahead, "token")
        evaluated = f"read {ahead} ahead as you typed; after Enter {evaluated}"
    if turn.history_reread:
        # The template rewrote part of the history (see the stats' reason).
        evaluated += f"\n({count(turn.history_reread, 'history token')} re-read: template)"
    if restore.restored:
        restored = count(restore.tokens, "token")
        return f"restored {restored} from saved cache in {restore.seconds:.2f} s\n{evaluated}"
    if restore.replayed:
        replayed = count(restore.replayed, "token")
        return f"re-evaluated {replayed} in {restore.seconds:.2f} s\n{evaluated}"
    reused = stats.prompt_tokens - stats.prompt_tokens_evaluated - restore.read_ahead
    return evaluated + (f"\nreused {reused:,} from the cache" if reused > 0 else "")
