"""The app's tool round: the calls a reply made are shown, asked about (unless the user
allowed the tool for the conversation), run, and answered; the chat screen then starts the
reply that reads the results.

Its interface is narrow on purpose (a runtime tool loop shared with the CLI is to take its
place): calls in, result messages out, the user's consent asked through one function."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from localchat.chat.template import ChatMessage, results_saying
from localchat.chat.tools import ToolCall
from localchat.conversation.base import NOT_RUN
from localchat.tools.consent import DENIED_RESULT, MAX_ROUNDS, STOPPED_RESULT, Consent
from localchat.tools.results import ToolResult, failure


@dataclass(frozen=True)
class ToolHooks:
    """What a round asks of the app."""

    ask: Callable[[ToolCall], Awaitable[str]]  # the user's choice (consent's RUN_ONCE...)
    run: Callable[[ToolCall], Awaitable[ToolResult]]  # run an allowed call
    shown: Callable[[ToolCall], Awaitable[Callable[[ToolResult], None]]]  # draw it; its result
    stopped: Callable[[], bool]  # the user stopped the reply


class ToolRound:
    """One round: ``calls`` in, ``results()`` out (one message per call, in their order)."""

    def __init__(self, calls: list[ToolCall], consent: Consent, hooks: ToolHooks) -> None:
        self.calls = calls
        self._consent = consent
        self._hooks = hooks
        self._results: list[ChatMessage] = []

    async def run(self) -> None:
        """Each call shown, and run where the user allows it; a denied call's result tells
        the model so. Stopped or failed part way, the calls left are answered by
        ``results``."""
        hooks = self._hooks
        for call in self.calls:
            show_result = await hooks.shown(call)
            allowed = self._consent.allows(call)
            if not allowed and not hooks.stopped():
                allowed = self._consent.answer(call, await hooks.ask(call))
            if hooks.stopped():
                result = failure("the user stopped the reply")
            elif allowed:
                result = await hooks.run(call)
            else:
                result = ToolResult(DENIED_RESULT, is_error=True)
            show_result(result)
            self._results.append(ChatMessage("tool", result.text, tool_call_id=call.id))

    def stop_all(self) -> None:
        """Too many rounds since the user's message: no call of this one runs."""
        self._results = results_saying(self.calls, STOPPED_RESULT)

    def results(self) -> list[ChatMessage]:
        """A result for every call: the ones run, and "not run" for the others."""
        answered = {m.tool_call_id for m in self._results}
        return self._results + results_saying(
            [c for c in self.calls if c.id not in answered], NOT_RUN
        )


class ToolRounds:
    """The rounds of one chat: the tools allowed for good in each conversation, and the
    rounds since the user's last message (a model that keeps calling stops at
    ``MAX_ROUNDS``)."""

    def __init__(self) -> None:
        self._consents: dict[str, Consent] = {}
        self.count = 0

    def next_round(
        self, conversation_id: str, calls: list[ToolCall], hooks: ToolHooks
    ) -> ToolRound:
        """The round for ``calls``: counted, with the conversation's consents."""
        self.count += 1
        consent = self._consents.setdefault(conversation_id, Consent())
        return ToolRound(calls, consent, hooks)

    @property
    def over(self) -> bool:
        """More rounds than a message may lead to."""
        return self.count > MAX_ROUNDS

    def reset(self) -> None:
        """The user's message is answered (or the round ended short)."""
        self.count = 0
