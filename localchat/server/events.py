"""What a reply gives back, typed, on its way from the scheduler to a wire API: every
adapter reads the same events and writes its own shape, so no API re-parses the reply or
learns its end from a string tag.

The scheduler emits ``Text``, ``Reasoning``, ``Called`` (the calls, parsed once where the
reply ends) and ``TextEnd``; the request's turn adds ``Finished`` or ``Failed``."""

from __future__ import annotations

from dataclasses import dataclass

from localchat.backends.base import TurnStats
from localchat.chat.tools import ToolCall

# Why a reply ended, the same for every API (each maps it to its own words):
# "stop" the model ended it; "stop_sequence" a stop string of the request's did;
# "length" its token limit; "context" the context filled; "tool_calls" it called tools;
# "cancelled" its client left.
END_REASONS = ("stop", "stop_sequence", "length", "context", "tool_calls", "cancelled")


@dataclass(frozen=True)
class Text:
    """A piece of the answer (never a stop string, nor a tool call's text)."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """A piece of the model's thinking (a reasoning model's ``<think>`` block)."""

    text: str


@dataclass(frozen=True)
class TokenChoice:
    """A token the model could write there, with its log probability."""

    text: str
    data: bytes  # the token's bytes (a piece of a character is not whole UTF-8)
    logprob: float


@dataclass(frozen=True)
class Logprob:
    """A token the reply took, its log probability and the most likely alternatives
    (where the request asked for ``logprobs``); it comes before the text it writes."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


@dataclass(frozen=True)
class Called:
    """The tools the reply called, read from the model's own format at its end."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class TextEnd:
    """The reply's text is all out (its state is still being saved): a stream's last
    piece need not wait for the disk."""


@dataclass(frozen=True)
class Finished:
    """The reply ended: why (``END_REASONS``), the stop string that ended it, its figures."""

    reason: str
    stats: TurnStats
    stop_sequence: str | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not evaluated: held in memory or restored from disk."""
        return max(0, self.stats.prompt_tokens - self.stats.prompt_tokens_evaluated)


@dataclass(frozen=True)
class Failed:
    """The reply could not go on; ``error`` is what the client is told."""

    error: Exception


Piece = Text | Reasoning | Logprob | Called | TextEnd  # what the scheduler emits
Event = Piece | Finished | Failed
