"""A turn as data: how its cache was prepared, what its window did, and its figures.

Built once by ``send`` and handed on (the app's messages, ``ask --json``, the stored
message's report all read the same objects).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from localchat.backends.base import Reply, TokenDelta, TurnStats
from localchat.chat.prompt import BuiltPrompt
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall
from localchat.errors import LocalchatError
from localchat.state.store import MessageRecord

if TYPE_CHECKING:
    from localchat.conversation.prefix_states import PrefixStart
    from localchat.state.store import ConversationRecord


class TurnOwner(Protocol):
    """What a turn asks of its conversation (``ConversationBase``): the record, where the
    finished reply is committed, and the branches its message has. A protocol, so the
    conversation imports the turn and not the other way round."""

    @property
    def record(self) -> ConversationRecord: ...

    def commit_reply(self, turn: ConversationTurn) -> Exchange: ...

    def branches_at(self, message_id: int) -> tuple[int, int]: ...


@dataclass
class RestoreReport:
    """How the turn's cache was prepared: restored from disk, reused in memory, or rebuilt.

    ``replayed`` tokens were re-evaluated from the transcript before the turn (in their
    original batches); ``seconds`` covers the restore or the replay.
    """

    restored: bool = False
    tokens: int = 0
    seconds: float = 0.0
    notice: str | None = None
    replayed: int = 0
    prefix_tokens: int = 0  # restored from a shared prefix state (a known system prompt)
    read_ahead: int = 0  # prompt tokens evaluated while the message was being typed
    images_encoded: int = 0  # images the projector encoded replaying (none kept)

    @classmethod
    def from_prefix(cls, start: PrefixStart | None, notice: str | None = None) -> RestoreReport:
        """How a cold start began: a prefix restored, or read and saved (counted as read
        before the turn), or nothing (None)."""
        if start is None:
            return cls(notice=notice)
        return cls(
            seconds=start.seconds,
            notice=notice,
            replayed=start.evaluated,
            prefix_tokens=start.restored,
        )


@dataclass(frozen=True)
class ReadAheadResult:
    """How many tokens the cache holds ahead of the conversation, and whether reading went
    as far as it could (False: it gave way to other work, and is to be asked again)."""

    tokens: int
    finished: bool = True


@dataclass
class Exchange:
    """A message as the conversation knows it: the stored record and its prompt form."""

    record: MessageRecord
    prompt: ChatMessage


@dataclass
class ConversationTurn:
    """A turn in progress; iterate for deltas. The reply is committed and the state saved when
    iteration ends, however it ends (finished, cancelled, interrupted)."""

    conversation: TurnOwner
    user: Exchange
    prompt: BuiltPrompt
    generation: Reply
    restore: RestoreReport
    started_at: float
    window: WindowReport
    messages: list[ChatMessage]  # what the prompt was built from (the window)
    reply: Exchange | None = None
    notices: list[str] = field(default_factory=list)
    # When the user sent the message (Enter in the app; else when ``send`` began), on
    # ``time.perf_counter``'s clock.
    entered_at: float = 0.0

    def __iter__(self) -> Iterator[TokenDelta]:
        try:
            yield from self.generation
        finally:
            self.reply = self.conversation.commit_reply(self)

    @property
    def stats(self) -> TurnStats:
        return self.generation.stats

    @property
    def resume_ttft_s(self) -> float:
        """Time to first token including the restore: what the user waited."""
        return self.restore.seconds + self.generation.stats.ttft_s

    @property
    def sent_ttft_s(self) -> float:
        """From the message being sent (Enter) to the first token: everything the user
        waited for, a step of reading ahead that was finishing included."""
        first = self.generation.stats.first_token_at
        if first is None:
            return self.resume_ttft_s
        return first - (self.entered_at or self.started_at)

    def stats_dict(self) -> dict[str, Any]:
        stats = turn_stats_dict(self.generation.stats, self.restore, self.window, self.prompt)
        stats["sent_ttft_s"] = round(self.sent_ttft_s, 6)
        return stats

    def finished(self, branches: bool = True) -> FinishedTurn:
        """The turn once iterated, as data: built where it ran (on the compute thread), so
        that whoever reads it later (the app's thread) reads neither the database nor the
        model. ``branches``: look up the user's message's place among its branches."""
        place = None
        if branches:
            with contextlib.suppress(LocalchatError):  # no longer in view
                place = self.conversation.branches_at(self.user.record.id)
        return FinishedTurn(
            conversation_id=self.conversation.record.id,
            stats=replace(self.stats),
            restore=replace(self.restore),
            window=self.window,
            prompt_tokens=tuple(self.prompt.tokens),
            history_reread=self.prompt.discarded,
            user_id=self.user.record.id,
            user_text=self.user.record.content,
            user_branches=place,
            reply_id=None if self.reply is None else self.reply.record.id,
            reply_text=self.generation.text,
            notices=tuple(self.notices),
            tool_calls=tuple(self.generation.tool_calls),
            sent_ttft_s=self.sent_ttft_s,
            resume_ttft_s=self.resume_ttft_s,
            report=MappingProxyType(self.stats_dict()),
        )


@dataclass(frozen=True)
class FinishedTurn:
    """A turn that ended, as the app's thread reads it: copies, ids and counts, nothing that
    reaches back into the conversation (see ``ConversationTurn.finished``)."""

    conversation_id: str
    stats: TurnStats  # a copy of the figures it ended with
    restore: RestoreReport  # a copy
    window: WindowReport
    prompt_tokens: tuple[int, ...]
    history_reread: int  # history tokens the template rewrote (the prompt's ``discarded``)
    user_id: int  # the stored message the turn answered (a results turn: the last result)
    user_text: str
    user_branches: tuple[int, int] | None  # (which, how many) at the user's message
    reply_id: int | None  # the stored reply (None: nothing was committed)
    reply_text: str
    notices: tuple[str, ...]
    tool_calls: tuple[ToolCall, ...]  # the calls the reply made
    sent_ttft_s: float
    resume_ttft_s: float
    report: Mapping[str, Any]  # ``stats_dict`` as the turn ended

    def stats_dict(self) -> dict[str, Any]:
        """The figures as ``ask --json`` reports them (a copy)."""
        return dict(self.report)


@dataclass(frozen=True)
class WindowReport:
    """What the window did this turn: how much left it, and how the cache followed."""

    mode: str = "none"  # "none" (it did not move), "shift" or "exact"
    dropped_messages: int = 0
    dropped_tokens: int = 0
    cut_tokens: int = 0
    kept_pinned: int = 0  # pinned messages among the old ones: they stay in the window

    def notices(self) -> list[str]:
        """What the user is told about it, one line each."""
        notices = []
        if self.dropped_messages:
            pinned = f"; {self.kept_pinned} pinned stay in it" if self.kept_pinned else ""
            notices.append(
                f"{self.dropped_messages} older messages ({self.dropped_tokens} tokens) left"
                f" the context window ({self.mode}); they stay in the transcript{pinned}"
            )
        if self.cut_tokens:
            notices.append(
                f"your message is longer than the context: its first {self.cut_tokens} tokens"
                " were left out (the full text is in the transcript)"
            )
        return notices


@dataclass
class ReplyStart:
    """What a backend prepared for a turn: the prompt (ids where they are known here), the
    reply's stream, how the cache was prepared, what the window did, and the messages sent."""

    prompt: BuiltPrompt
    generation: Reply
    restore: RestoreReport
    window: WindowReport
    messages: list[ChatMessage]


def turn_stats_dict(
    stats: TurnStats,
    restore: RestoreReport | None = None,
    window: WindowReport | None = None,
    prompt: BuiltPrompt | None = None,
) -> dict[str, Any]:
    """A turn's figures as ``ask --json`` and the stored message report them."""
    restore = restore or RestoreReport()
    window = window or WindowReport()
    prompt = prompt or BuiltPrompt([])
    return {
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_evaluated": stats.prompt_tokens_evaluated + restore.replayed,
        # Of the prompt, what came from the cache (in memory, restored, read ahead) unread.
        "kept_tokens": max(
            0, stats.prompt_tokens - stats.prompt_tokens_evaluated - restore.replayed
        ),
        "generated_tokens": stats.generated_tokens,
        # Images encoded by the projector this turn: their embeddings were not kept.
        "images_encoded": stats.images_encoded + restore.images_encoded,
        "ttft_s": round(restore.seconds + stats.ttft_s, 6),
        "prompt_tps": round(stats.prompt_tps, 3),
        "gen_tps": round(stats.gen_tps, 3),
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "draft_steps": stats.draft_steps,
        "speculative_speedup": (
            None if stats.speculative_speedup is None else round(stats.speculative_speedup, 3)
        ),
        "kv_bytes_used": stats.kv_bytes_used,
        "kv_bytes_allocated": stats.kv_bytes_allocated,
        "server_kv_usage": stats.server_kv_usage,
        "tokens_counted_by": stats.counted,
        "restored_from_state": restore.restored,
        "restored_tokens": restore.tokens,
        "restored_prefix_tokens": restore.prefix_tokens,
        "read_ahead_tokens": restore.read_ahead,
        "restore_s": round(restore.seconds, 6),
        "window_dropped_messages": window.dropped_messages,
        "window_dropped_tokens": window.dropped_tokens,
        "window_cut_tokens": window.cut_tokens,
        "window_mode": window.mode,
        "history_reevaluated_tokens": prompt.discarded,
        "history_reevaluated_reason": prompt.discarded_reason,
        "stop_reason": stats.stop_reason,
    }
