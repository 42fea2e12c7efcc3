"""A stored conversation answered by a server: the same transcript, window and figures as a
local one, without a KV cache of localchat's own (the server keeps its prefix cache).

The window is planned with the server's token counts where it can count (else estimates),
against its context where it publishes one. A server that still answers "context length
exceeded" gets the turn once more with older exchanges out of the window.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from localchat.backends.base import Sampling
from localchat.backends.remote import IMAGE_TOKENS_GUESS, ContextExceeded, RemoteBackend
from localchat.chat.images import image_at_after_cut
from localchat.chat.prompt import BuiltPrompt
from localchat.chat.template import ChatMessage
from localchat.chat.window import WindowPlan, plan_window
from localchat.conversation.base import ConversationBase, open_record
from localchat.conversation.turn import ReplyStart, RestoreReport, WindowReport
from localchat.errors import UsageError
from localchat.state.kvstate import StateStore
from localchat.state.store import Store

# Tokens a template adds to open the reply (the assistant header).
GENERATION_HEADER_TOKENS = 4
# The window mode the figures name: the server re-reads what it does not cache itself.
SERVER_WINDOW_MODE = "server"


class RemoteConversation(ConversationBase):
    """A stored conversation bound to a model on a server."""

    backend: RemoteBackend  # the base stores it; the server's client, typed as such

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

    def _start_reply(
        self,
        sampling: Sampling | None,
        max_tokens: int,
        cancel: threading.Event | None,
        fresh: bool,
    ) -> ReplyStart:
        """Fit the window and open the reply's stream (``fresh`` changes nothing here: the
        server's cache is the server's)."""
        messages, window, room = self._fit_window(max_tokens)
        try:
            reply = self.backend.stream(messages, sampling, room, cancel, self.tool_use)
        except ContextExceeded as exc:
            # The server knows its context better than the counts here: once more, with the
            # window planned against what it said (or about half the history out).
            if exc.limit:
                self.backend.learn_context_size(exc.limit)
            messages, window, room = self._fit_window(max_tokens, shrink=True, moved=window)
            reply = self.backend.stream(messages, sampling, room, cancel, self.tool_use)
        return ReplyStart(BuiltPrompt([]), reply, RestoreReport(), window, messages)

    def _counts(self) -> list[tuple[str, int]]:
        window = self.exchanges[self.window_first :]
        return [(e.prompt.role, self.backend.message_tokens(e.prompt)) for e in window]

    def _fit_window(
        self, max_tokens: int, shrink: bool = False, moved: WindowReport | None = None
    ) -> tuple[list[ChatMessage], WindowReport, int]:
        """The messages to send, what the window did, and the reply's room (vLLM refuses a
        prompt plus ``max_tokens`` beyond its context). ``shrink``: the server refused the last
        try though these counts said it fits, so about half of them leave."""
        moved = moved or WindowReport()
        counts = self._counts()
        head_messages = self.window_messages()[: self.head_count()]  # system prompt, pins
        head = sum(self.backend.message_tokens(m) for m in head_messages)
        total = head + sum(n for _, n in counts) + GENERATION_HEADER_TOKENS
        n_ctx = self.backend.context_size
        reserve = self.window_policy.reserve(n_ctx, max_tokens) if n_ctx else max_tokens
        if shrink and (not n_ctx or n_ctx >= total + reserve):
            n_ctx = (total + reserve) // 2  # the counts were wrong: plan for half of them
        plan: WindowPlan | None = None
        if n_ctx:
            reserve = self.window_policy.reserve(n_ctx, max_tokens)
            plan = plan_window(
                head,
                counts,
                0,
                n_ctx,
                reserve,
                self.window_policy,
                GENERATION_HEADER_TOKENS,
                self.pinned_flags(len(counts)),
            )
        if plan is not None and (plan.moved or plan.cut_tokens):
            passed = self.exchanges[self.window_first : self.window_first + plan.first]
            self.window_first += plan.first
            total -= plan.dropped_tokens
            moved = WindowReport(
                SERVER_WINDOW_MODE,
                moved.dropped_messages + plan.dropped_messages,
                moved.dropped_tokens + plan.dropped_tokens,
                plan.cut_tokens,
                moved.kept_pinned + sum(1 for e in passed if e.record.pinned),
            )
        messages = self.window_messages()
        if plan is not None and plan.cut_tokens:
            newest = messages[-1]
            messages[-1] = _cut_text(newest, plan.cut_tokens, self.backend.message_tokens(newest))
            total -= plan.cut_tokens
        room = max_tokens if not n_ctx else max(1, min(max_tokens, n_ctx - total))
        return messages, moved, room


def _cut_text(message: ChatMessage, cut_tokens: int, tokens: int) -> ChatMessage:
    """The newest message without its first ``cut_tokens`` of ``tokens`` (cut by the same
    share of its text's characters: the server's tokenizer is not here to cut exactly);
    its images stay, and where they alone do not fit it is refused, never sent without."""
    images = IMAGE_TOKENS_GUESS * len(message.images)
    text_tokens = max(1, tokens - images)
    if images and cut_tokens >= text_tokens:
        raise UsageError(
            f"this message's {len(message.images)} image(s) take more of the server's context"
            " than is left for them: send fewer or smaller images, or use a larger context"
        )
    keep_share = max(0.0, 1.0 - cut_tokens / text_tokens)
    keep = max(1, int(len(message.content) * keep_share))
    text = message.content[-keep:].lstrip()
    at = image_at_after_cut(message.images, message.image_at, message.content, text)
    return replace(message, content=text, image_at=at)
