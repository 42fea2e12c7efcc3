"""``ask`` with tools: the runtime's tool loop (``tools.loop``) with the command line's
hooks. A call runs only where the user allowed it beforehand (``--allow-tool NAME``,
``--yes``): ``ask`` cannot ask, so a call not allowed ends the ask, saying how to allow it.
Each call and result is one line on stderr (text, cut, control characters shown)."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolUse
from localchat.text import shown
from localchat.tools.consent import Consent
from localchat.tools.loop import ToolTurns
from localchat.tools.results import ToolResult

if TYPE_CHECKING:
    from collections.abc import Iterator

    from localchat.backends.base import Backend, Reply, Sampling, TokenDelta
    from localchat.conversation.base import ConversationBase
    from localchat.conversation.one_off import OneOffTurn
    from localchat.conversation.turn import ConversationTurn
    from localchat.session import Session
    from localchat.state.kvstate import StateStore


class AskTurn(Protocol):
    """A reply as ``ask`` streams and reports it (a conversation's turn or a one-off one)."""

    @property
    def generation(self) -> Reply: ...

    @property
    def notices(self) -> list[str]: ...

    def stats_dict(self) -> dict[str, Any]: ...

    def __iter__(self) -> Iterator[TokenDelta]: ...


class AskReplies(ToolTurns[AskTurn], Protocol):
    """Where ``ask``'s replies come from: the first, the ones after calls, and the save."""

    def first(self) -> AskTurn: ...

    def wait_saved(self) -> str | None:
        """Once the conversation's state is on disk: what went wrong saving it, if anything."""
        ...


@dataclasses.dataclass
class AskHooks:
    """The loop's hooks for ``ask``: consent from the flags, lines on stderr."""

    session: Session
    consent: Consent
    err: TextIO | None = None
    refusal_ends: bool = True

    def allow(self, call: ToolCall) -> bool:
        return self.consent.allows(call)

    def run(self, call: ToolCall) -> ToolResult:
        self._say(f"running {_spelled(call)}")
        return self.session.tools.run(call)

    def answered(self, call: ToolCall, result: ToolResult | None) -> None:
        if result is not None:
            outcome = "failed" if result.is_error else "returned"
            self._say(f"{shown(call.name)} {outcome}: {shown(result.text, 200)}")
        elif not self.consent.allows(call):
            self._say(
                f"the model called {_spelled(call)}; not run: allow it with"
                f" --allow-tool {shown(call.name)} (or --yes)"
            )

    def stopped(self, line: str) -> None:
        self._say(line)

    def _say(self, line: str) -> None:
        print(f"localchat: tool: {line}", file=self.err or sys.stderr)


@dataclasses.dataclass
class ConversationReplies:
    """A saved conversation's replies: results go into it, its next reply reads them (the
    cache holds the rest)."""

    conversation: ConversationBase
    sampling: Sampling
    max_tokens: int
    cancel: threading.Event
    message: str
    fresh: bool = False
    images: tuple[str, ...] = ()  # the keys of the images the message shows

    def first(self) -> ConversationTurn:
        """The reply to the user's message (``fresh``: evaluated from scratch)."""
        return self.conversation.send(
            self.message,
            self.sampling,
            self.max_tokens,
            self.cancel,
            fresh=self.fresh,
            images=self.images,
        )

    def wait_saved(self) -> str | None:
        """Once the conversation's state is on disk: what went wrong saving it, if anything."""
        return self.conversation.wait_saved()

    def calls(self, reply: AskTurn) -> Sequence[ToolCall]:
        return reply.generation.tool_calls

    def next_reply(self, reply: AskTurn, results: list[ChatMessage]) -> ConversationTurn:
        return self.conversation.send_results(results, self.sampling, self.max_tokens, self.cancel)

    def keep(self, results: list[ChatMessage]) -> None:
        self.conversation.record_results(results)


@dataclasses.dataclass
class OneOffReplies:
    """A one-off ask's replies: each next reply reads the whole exchange so far (a local
    model starts it from the saved prefix state); nothing is kept."""

    backend: Backend
    states: StateStore  # where the prefix states are
    prefix_min_tokens: int
    messages: list[ChatMessage]
    sampling: Sampling
    max_tokens: int
    cancel: threading.Event
    tool_use: ToolUse | None

    def first(self) -> OneOffTurn:
        return self._ask()

    def calls(self, reply: AskTurn) -> Sequence[ToolCall]:
        return reply.generation.tool_calls

    def next_reply(self, reply: AskTurn, results: list[ChatMessage]) -> OneOffTurn:
        generation = reply.generation
        self.messages += [ChatMessage("assistant", generation.text, tuple(generation.tool_calls))]
        self.messages += results
        if self.tool_use is not None:
            self.tool_use = self.tool_use.after_call()
        return self._ask()

    def keep(self, results: list[ChatMessage]) -> None:
        """A one-off ask keeps nothing."""

    def wait_saved(self) -> str | None:
        return None

    def _ask(self) -> OneOffTurn:
        from localchat.conversation.one_off import ask_once

        return ask_once(
            self.backend,
            self.states,
            self.messages,
            self.sampling,
            self.max_tokens,
            self.cancel,
            self.tool_use,
            self.prefix_min_tokens,
        )


def _spelled(call: ToolCall) -> str:
    """``name({"arg": …})`` on one line, shortened."""
    return shown(f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})", 200)
