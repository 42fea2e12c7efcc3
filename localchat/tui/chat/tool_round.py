"""The app's hooks into the runtime's one tool loop (``localchat.tools.loop``): the loop runs
in a thread worker, as ``ask``'s does on its thread; what it shows and asks (a call drawn,
the consent dialog, a result) happens on the app's thread through ``call_from_thread``.

The rules (the round limit, every call answered once and in order, a stop answering what
is left) are the loop's; this module only supplies the app's side of each hook."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar, cast

from textual.app import App

from localchat.chat.tools import ToolCall
from localchat.tools.consent import DENIED_RESULT, DENY, Consent
from localchat.tools.loop import ToolLoop
from localchat.tools.results import ToolResult
from localchat.tui.widgets.chat_message import ToolCallView

if TYPE_CHECKING:
    from localchat.session import Session

T = TypeVar("T")
P = ParamSpec("P")


def on_app_thread(
    app: App[object], work: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
) -> T:
    """Await ``work`` on the app's thread from another thread, and give back its result
    (``App.call_from_thread``, typed for a coroutine; RuntimeError once the app has quit)."""
    call: Callable[..., object] = app.call_from_thread  # its stub cannot say "a coroutine's T"
    return cast(T, call(work, *args, **kwargs))


@dataclass
class AppToolHooks:
    """The loop's hooks in the app: a call is drawn as it comes, asked about in a dialog
    unless the user allowed its tool for the conversation, and its result drawn on it. A
    refused call's result tells the model so, and the model reads on. Once the app quits
    (``gone``) nothing more is drawn or asked: the loop answers the calls on its own."""

    app: App[object]
    consent: Consent
    show_call: Callable[[ToolCall], Awaitable[ToolCallView]]  # on the app's thread
    # Shows the consent dialog for a call (and its server) on the app's thread; the dialog
    # gives its answer to the callback.
    open_dialog: Callable[[ToolCall, str | None, Callable[[str | None], None]], object]
    session: Session | None
    stop: threading.Event  # the user stopped the reply
    gone: Callable[[], bool]
    pending: PendingAnswer
    refusal_ends: bool = False
    views: dict[str, ToolCallView] = field(default_factory=dict)

    def allow(self, call: ToolCall) -> bool:
        if self.gone():
            return False
        self.views[call.id] = on_app_thread(self.app, self.show_call, call)
        return self.consent.allows(call) or self.consent.answer(call, self._ask(call))

    def run(self, call: ToolCall) -> ToolResult:
        if self.session is None:
            return ToolResult(DENIED_RESULT, is_error=True)
        return self.session.tools.run(call, self.stop)

    def answered(self, call: ToolCall, result: ToolResult | None) -> None:
        if not self.gone():
            on_app_thread(self.app, self._show_result, call, result)

    def stopped(self, line: str) -> None:
        self.app.notify(line, title="Tools")  # Textual's notify is thread-safe

    def _ask(self, call: ToolCall) -> str:
        """The user's answer, waited for on this (the loop's) thread."""
        server = self.session.tools.server_of(call.name) if self.session is not None else None
        return self.pending.wait(
            lambda done: self.app.call_from_thread(self.open_dialog, call, server, done)
        )

    async def _show_result(self, call: ToolCall, result: ToolResult | None) -> None:
        view = self.views.get(call.id) or await self.show_call(call)  # stopped before asked
        if result is None:
            result = ToolResult(DENIED_RESULT, is_error=True)
        view.show_result(result.text, result.is_error)


class PendingAnswer:
    """The consent dialog's answer, waited for on the loop's thread (not on the app's loop:
    quitting blocks that loop while it waits for the round to end). A stop (Esc, the app
    quitting) answers it "deny", so the thread never waits on a dialog that is gone."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._future: Future[str] | None = None

    def wait(self, open_dialog: Callable[[Callable[[str | None], None]], object]) -> str:
        """``open_dialog(done)`` shows the dialog (from this thread), which calls ``done``
        with the answer."""
        future: Future[str] = Future()
        self._future = future
        if self._stop.is_set():  # stopped before the dialog could open
            return DENY
        try:
            open_dialog(lambda choice: _settle(future, choice or DENY))
            return future.result()
        finally:
            self._future = None

    def deny(self) -> None:
        """Called after ``stop`` is set."""
        future = self._future
        if future is not None:
            _settle(future, DENY)


def _settle(future: Future[str], choice: str) -> None:
    with contextlib.suppress(InvalidStateError):  # answered already (a click, then a stop)
        future.set_result(choice)


class ToolRounds:
    """The chat's tool loops: the tools each conversation allowed for good, and the loop of
    the message being answered (its rounds count toward the limit until it is answered)."""

    def __init__(self) -> None:
        self._consents: dict[str, Consent] = {}
        self.loop: ToolLoop | None = None

    def consent(self, conversation_id: str) -> Consent:
        return self._consents.setdefault(conversation_id, Consent())

    def reset(self) -> None:
        """The user's message is answered (or its rounds ended short)."""
        self.loop = None
