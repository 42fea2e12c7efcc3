"""A request as the scheduler holds it (``Job``) and a job holding a sequence (``Slot``):
everything one sequence's reply owns — its ids, sampler, stop strings, tool-call reading
and drafting state — in one object, and the way its text goes out as typed events."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from localchat.backends.base import TurnStats
from localchat.backends.llama.draft_policy import Draft, DraftPolicy
from localchat.backends.llama.generation import ReplyText
from localchat.backends.llama.sampler import SequenceSampler
from localchat.chat.prompt import common_prefix
from localchat.chat.stops import StopFilter
from localchat.chat.tool_stream import ToolCallStream
from localchat.chat.tools import ToolCall
from localchat.server.events import Called, Piece, Reasoning, Text, TextEnd
from localchat.server.prompt_cache import CacheHit
from localchat.server.requests import GenerationRequest

# What a reply emits: ``Text`` and ``Reasoning`` pieces, ``Called`` where it called tools,
# then ``TextEnd`` once its text is all out (before its state is saved: a stream's last
# piece need not wait for the save).
Emit = Callable[[Piece], None]
# The scheduler's reasons a reply ended (``TurnStats.stop_reason``) in the events' words.
_END_REASONS = {"eos": "stop", "stop": "stop"}


@dataclass
class Job:
    """One request: its prompt ids, how long its reply may be, where its pieces go."""

    request: GenerationRequest
    prompt: list[int]
    max_tokens: int
    cancel: threading.Event
    emit: Emit
    done: threading.Event = field(default_factory=threading.Event)
    stats: TurnStats = field(default_factory=TurnStats)
    hit: CacheHit | None = None  # the saved state found for it (read off the compute thread)
    restored: int = 0  # prompt tokens restored from a state on disk
    started: bool = False  # it held a sequence (else it left the queue unanswered)
    spelled: frozenset[int] = frozenset()  # control tokens its text keeps (tool calls)
    grammar: str | None = None  # GBNF the reply must follow (a required call, a format)
    calls: tuple[ToolCall, ...] = ()  # the tools the reply called (parsed once, at its end)
    reason: str = ""  # why it ended (``events.END_REASONS``)
    stop_sequence: str | None = None  # the request's stop string that ended it
    expected_cached: int = 0  # prompt tokens it should find in memory or on disk
    after: Job | None = None  # a job whose prompt it shares: started once that one read it
    image_starts: tuple[int, ...] = ()  # where the prompt's images start (``image_positions``)
    error: BaseException | None = None

    def text_end(self, start: int) -> int:
        """Where the prompt's text from ``start`` ends: at its next image, else its end."""
        starts = self.image_starts
        index = bisect.bisect_left(starts, start)
        return starts[index] if index < len(starts) else len(self.prompt)


@dataclass
class Slot:
    """A job holding a sequence."""

    job: Job
    seq: int
    reply: ReplyText
    stops: StopFilter  # the request's own stop strings
    sampler: SequenceSampler
    continues: str | None  # the saved state this sequence extends (replaced by its own)
    started: float
    reused: int  # prompt tokens the sequence held when the job started
    next_token: int | None = None  # sampled, not yet evaluated
    first_at: float = 0.0
    request_stopped: bool = False  # the request's own stop string ended the reply
    policy: DraftPolicy | None = None  # its drafts' acceptance (step costs: the scheduler's)
    draft: Draft = field(default_factory=lambda: Draft([]))  # verified in this step
    calls: ToolCallStream | None = None  # where the reply is read for tool calls

    def emit(self, text: str, reasoning: bool) -> None:
        """Send a piece on (a raw completion's reasoning is just its text), through the
        request's own stop strings; a reader that fails (its client gone) cancels the job."""
        job = self.job
        if self.request_stopped:
            return
        try:
            if reasoning and job.request.messages is not None:
                job.emit(Reasoning(text))
                return
            text, self.request_stopped = self.stops.feed(text)
            self._send(text)
        except Exception:
            job.cancel.set()

    def send(self, event: Piece) -> None:
        """Send an event on as it is (until the request's stop string ended the reply); a
        reader that fails cancels the job."""
        if self.request_stopped:
            return
        try:
            self.job.emit(event)
        except Exception:
            self.job.cancel.set()

    def _send(self, text: str) -> None:
        """Answer text on to the request, a call's text held back where calls are read."""
        if self.calls is not None:
            text = self.calls.feed(text)
        if text:
            self.job.emit(Text(text))

    def end(self, reason: str) -> None:
        """The reply ended (``reason``: the scheduler's): the text held back, the calls it
        made (parsed once, here), the word that the text is all out, and why it ended."""
        job = self.job
        if not self.request_stopped:
            for delta in self.reply.flush():
                self.emit(delta.text, delta.reasoning)
        try:
            if not self.request_stopped:
                self._send(self.stops.flush())
            if self.calls is not None:
                rest, calls = self.calls.finish()
                if rest.strip() if calls else rest:
                    job.emit(Text(rest.rstrip() if calls else rest))
                if calls:
                    job.calls = tuple(calls)
                    job.emit(Called(job.calls))
            job.emit(TextEnd())
        except Exception:
            job.cancel.set()
        job.stats.stop_reason = reason
        if self.request_stopped:
            job.reason, job.stop_sequence = "stop_sequence", self.stops.matched
        elif job.calls and reason != "cancelled":
            job.reason = "tool_calls"
        else:
            job.reason = _END_REASONS.get(reason, reason)


@dataclass
class HeldState:
    """The saved state a sequence holds: its id, its tokens, and how many of them its
    request sent (``prompt``; the rest its reply as generated; all of them for a state read
    from disk, whose reply is not told apart)."""

    sid: str
    tokens: list[int]
    prompt: int = -1

    def __post_init__(self) -> None:  # a reply stopped inside its prompt holds less of it
        self.prompt = len(self.tokens) if self.prompt < 0 else min(self.prompt, len(self.tokens))

    def continued_by(self, prompt: Sequence[int]) -> bool:
        """Whether a request of ``prompt`` continues this state, so that its own replaces it:
        it holds all this state's request sent. The reply need not be there as generated:
        an agent resends a tool call as its template renders it, which differs from the
        tokens the model wrote, and each turn's state then stayed beside the last (30 of
        110 MB in a 10-turn loop on three APIs outgrew the 2 GB budget, and the first
        loop's states went)."""
        return common_prefix(self.tokens, prompt) >= self.prompt
