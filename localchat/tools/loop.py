"""One tool loop for every caller: a reply's calls → the user's consent (a hook the caller
supplies: flags on the command line, a dialog in the app) → each allowed call run → the
results read by the next reply, until a reply calls nothing, the user stops it, or
``MAX_ROUNDS`` rounds have run (simonw/llm's ``chain()`` is the model).

The loop knows calls, results and consent; what a reply is, and how the next one starts
(a conversation's ``send_results``, a one-off ask's longer message list), are the caller's,
given as a ``ToolTurns``. The rules live here once: every call gets exactly one result, in
order; a call not allowed is never run; a stopped round answers what it did not run."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from localchat.chat.template import ChatMessage, results_saying
from localchat.chat.tools import NOT_RUN, ToolCall
from localchat.tools.consent import DENIED_RESULT, MAX_ROUNDS, STOPPED, STOPPED_RESULT
from localchat.tools.results import ToolResult, failure

STOPPED_BY_USER = "the user stopped the reply"


class ToolHooks(Protocol):
    """What the caller decides and shows. ``refusal_ends`` True: a call not allowed ends the
    loop before any call of its round runs (``ask`` cannot ask, so it stops and says how to
    allow it); False: the model is told the call was refused and reads on (the app)."""

    refusal_ends: bool

    def allow(self, call: ToolCall) -> bool:
        """Whether ``call`` may run: allowed already, or asked of the user (may block)."""
        ...

    def run(self, call: ToolCall) -> ToolResult:
        """Run an allowed call."""
        ...

    def answered(self, call: ToolCall, result: ToolResult | None) -> None:
        """What became of ``call`` (None: not run), for the user to see."""
        ...

    def stopped(self, line: str) -> None:
        """The loop ended on its round limit: ``line`` says so."""
        ...


R = TypeVar("R")


class ToolTurns(Protocol[R]):
    """Where the replies come from: the calls a reply made, the reply that reads their
    results, and results kept with no reply after them (the loop ended there)."""

    def calls(self, reply: R) -> Sequence[ToolCall]: ...

    def next_reply(self, reply: R, results: list[ChatMessage]) -> R:
        """The reply that reads ``results``, the answers to ``reply``'s calls."""
        ...

    def keep(self, results: list[ChatMessage]) -> None: ...


@dataclass
class CallRecord:
    """A call and what became of it (``result`` None: it did not run)."""

    call: ToolCall
    result: ToolResult | None

    def as_json(self) -> dict[str, Any]:
        """The call and its result as ``ask --json`` prints them."""
        result = self.result
        return {
            "id": self.call.id,
            "name": self.call.name,
            "arguments": self.call.arguments,
            "allowed": result is not None,
            "result": None if result is None else result.text,
            "is_error": None if result is None else result.is_error,
        }


@dataclass(frozen=True)
class Round:
    """One round's answer: a result message for each call, in order, and whether the next
    reply reads them (False: the loop ends; the caller keeps the results). ``error``: a hook
    raised it; the calls it left are answered as not run."""

    results: list[ChatMessage]
    go_on: bool
    error: Exception | None = None


@dataclass
class ToolLoop:
    """The rounds of calls one message leads to. ``cancel`` set: the user stopped the reply,
    and no further call runs."""

    hooks: ToolHooks
    cancel: threading.Event = field(default_factory=threading.Event)
    rounds: int = 0
    records: list[CallRecord] = field(default_factory=list)

    @property
    def refused(self) -> list[ToolCall]:
        """Calls that did not run because the user did not allow them."""
        return [r.call for r in self.records if r.result is None]

    def answer(self, calls: Sequence[ToolCall]) -> Round:
        """Answer one reply's calls: consent, run, result. Every call gets one result, also
        where the round ends early (stopped, refused, the round limit, an exception)."""
        self.rounds += 1
        if self.rounds > MAX_ROUNDS:
            self.hooks.stopped(STOPPED)
            return Round(results_saying(calls, STOPPED_RESULT), go_on=False)
        if self.hooks.refusal_ends and not all(self.hooks.allow(call) for call in calls):
            for call in calls:
                self.records.append(CallRecord(call, None))
                self.hooks.answered(call, None)
            return Round(results_saying(calls, DENIED_RESULT), go_on=False)
        results: list[ChatMessage] = []
        try:
            for call in calls:
                result = self._answer_one(call)
                results.append(ChatMessage("tool", result.text, tool_call_id=call.id))
        except Exception as exc:  # the caller says it; the calls are answered all the same
            results += results_saying(calls[len(results) :], NOT_RUN)
            return Round(results, go_on=False, error=exc)
        return Round(results, go_on=not self.cancel.is_set())

    def _answer_one(self, call: ToolCall) -> ToolResult:
        # Under ``refusal_ends`` every call of the round was allowed before any ran.
        allowed = not self.cancel.is_set() and (self.hooks.refusal_ends or self.hooks.allow(call))
        if self.cancel.is_set():  # also while the user was being asked
            result: ToolResult | None = failure(STOPPED_BY_USER)
        elif allowed:
            result = self.hooks.run(call)
        else:
            result = None
        self.records.append(CallRecord(call, result))
        self.hooks.answered(call, result)
        return result if result is not None else ToolResult(DENIED_RESULT, is_error=True)


def chain(loop: ToolLoop, turns: ToolTurns[R], first: R) -> Iterator[R]:
    """The replies one message leads to, each yielded for the caller to read (stream) before
    the loop looks at its calls; a caller that stops reading ends the chain there."""
    reply = first
    while True:
        yield reply
        calls = turns.calls(reply)
        if not calls or loop.cancel.is_set():
            return
        answer = loop.answer(calls)
        if not answer.go_on:
            turns.keep(answer.results)
            if answer.error is not None:
                raise answer.error
            return
        reply = turns.next_reply(reply, answer.results)
