"""A stored conversation answered by a server: the same transcript, window and figures as a
local one, without a KV cache of localchat's own (the server keeps its prefix cache).

The window is planned with the server's token counts where it can count (else estimates),
against its context where it publishes one. A server that still answers "context length
exceeded" gets the turn once more with older exchanges out of the window.
"""

from __future__ import annotations

import threading
import time

from localchat.backend import Sampling
from localchat.chat_template import ChatMessage
from localchat.conversation import (
    ConversationBase,
    ConversationTurn,
    Exchange,
    RestoreReport,
    WindowReport,
    open_record,
)
from localchat.kvstate import StateStore
from localchat.prompt import BuiltPrompt
from localchat.remote import CHARS_PER_TOKEN, ContextExceeded, RemoteBackend
from localchat.store import ConversationRecord, Store
from localchat.window import WindowPlan, WindowPolicy, plan_window

# Tokens a template adds to open the reply (the assistant header).
GENERATION_HEADER_TOKENS = 4
# The window mode the figures name: the server re-reads what it does not cache itself.
SERVER_WINDOW_MODE = "server"


class RemoteConversation(ConversationBase):
    """A stored conversation bound to a model on a server."""

    def __init__(
        self,
        store: Store,
        states: StateStore,
        record: ConversationRecord,
        backend: RemoteBackend,
        window_policy: WindowPolicy | None = None,
        wait_s: float = 0.0,
    ) -> None:
        super().__init__(store, states, record, backend.fingerprint, window_policy, wait_s)
        self.backend = backend

    @classmethod
    def open(
        cls,
        store: Store,
        states: StateStore,
        name: str,
        backend: RemoteBackend,
        system_prompt: str | None = None,
        wait_s: float = 0.0,
    ) -> RemoteConversation:
        """Open ``name``, creating it if new; a given system prompt replaces the stored one."""
        record = open_record(store, name, system_prompt, backend.model_name)
        return cls(store, states, record, backend, wait_s=wait_s)

    def send(
        self,
        text: str,
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        fresh: bool = False,
    ) -> ConversationTurn:
        """Commit the user's message, fit the window, and open the reply's stream. ``fresh``
        changes nothing here: the server's cache is the server's."""
        started = time.perf_counter()
        user = self._commit_user(text)
        window_before = self.window_first
        try:
            messages, window = self._fit_window(max_tokens)
            try:
                reply = self.backend.stream(messages, sampling, max_tokens, cancel)
            except ContextExceeded as exc:
                # The server knows its context better than the counts here: once more, with
                # the window planned against what it said (or half the history out).
                if exc.limit:
                    self.backend.learn_context_size(exc.limit)
                messages, window = self._fit_window(max_tokens, shrink=True, moved=window)
                reply = self.backend.stream(messages, sampling, max_tokens, cancel)
        except BaseException:
            self._take_back_user(user, window_before)
            raise
        turn = ConversationTurn(
            self, user, BuiltPrompt([]), reply, RestoreReport(), started, window, messages
        )
        turn.notices.extend(self._window_notices(window))
        return turn

    def _counts(self) -> list[tuple[str, int]]:
        window = self.exchanges[self.window_first :]
        return [(e.prompt.role, self.backend.message_tokens(e.prompt)) for e in window]

    def _fit_window(
        self, max_tokens: int, shrink: bool = False, moved: WindowReport | None = None
    ) -> tuple[list[ChatMessage], WindowReport]:
        """The messages to send and what the window did; ``shrink``: the server refused the
        last try, so at least the oldest exchange leaves even by these counts."""
        moved = moved or WindowReport()
        n_ctx = self.backend.context_size
        counts = self._counts()
        head = sum(self.backend.message_tokens(m) for m in self.system_messages())
        plan: WindowPlan | None = None
        if n_ctx:
            reserve = self.window_policy.reserve(n_ctx, max_tokens)
            plan = plan_window(
                head, counts, 0, n_ctx, reserve, self.window_policy, GENERATION_HEADER_TOKENS
            )
        if shrink and (plan is None or not plan.moved):
            plan = _drop_older_half(counts)
        if plan is None or not (plan.moved or plan.cut_tokens):
            return self.window_messages(), moved
        self.window_first += plan.first
        messages = self.window_messages()
        if plan.cut_tokens:
            messages[-1] = _cut_text(messages[-1], plan.cut_tokens)
        report = WindowReport(
            SERVER_WINDOW_MODE,
            moved.dropped_messages + plan.dropped_messages,
            moved.dropped_tokens + plan.dropped_tokens,
            plan.cut_tokens,
        )
        return messages, report

    def _finish(self, turn: ConversationTurn) -> Exchange:
        reply = self._store_reply(turn.generation, turn.stats_dict(), self.backend.model_name)
        self._record_window_start()
        return reply


def _drop_older_half(counts: list[tuple[str, int]]) -> WindowPlan:
    """Without a context size to plan against: the older half of the window leaves (whole
    exchanges, the window starting at a user message; the newest message always stays)."""
    newest = len(counts) - 1
    start = max(1, newest // 2) if newest > 0 else 0
    while 0 < start < newest and counts[start][0] != "user":
        start += 1
    dropped = sum(n for _, n in counts[:start])
    return WindowPlan(start, start, dropped)


def _cut_text(message: ChatMessage, cut_tokens: int) -> ChatMessage:
    """The newest message without about its first ``cut_tokens`` tokens (by characters: the
    server's tokenizer is not here to cut exactly)."""
    keep = max(1, len(message.content) - cut_tokens * CHARS_PER_TOKEN)
    return ChatMessage(message.role, message.content[-keep:].lstrip())
