"""Driving the app in pilot tests. The app works in threads: a test waits for a message it
posts (``wait_for``) or for a condition to hold (``until``), never for a fixed time.

Most tests open the app with ``chat_app``::

    async with chat_app(tiny_model, n_ctx=512, max_tokens=8) as ui:
        finished = await ui.say("hello")
        assert ui.app.conversation is not None
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from textual.message import Message
from textual.notifications import Notification
from textual.pilot import Pilot
from textual.screen import Screen
from textual.widgets import Static

from localchat.conversation.base import ConversationBase
from localchat.models.launch import LaunchOptions
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ModelLoaded, ReplyFinished
from localchat.tui.widgets.chat_message import ChatEntry
from tests.conftest import GREEDY

M = TypeVar("M", bound=Message)
S = TypeVar("S", bound=Screen[Any])

POLL_S = 0.05  # how often a wait looks again


async def wait_for(
    pilot: Pilot, seen: list[Message], kind: type[M], timeout_s: float = 60.0, after: int = 0
) -> M:
    """The first ``kind`` message in ``seen[after:]``, waiting (pausing the pilot) for it.

    The message hook sees a message just before its handler runs: wait on what the handler
    does (``until``) where a test reads its effect."""
    waited = 0.0
    while waited < timeout_s:
        for message in seen[after:]:
            if isinstance(message, kind):
                return message
        await pilot.pause(POLL_S)
        waited += POLL_S
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


async def until(
    pilot: Pilot,
    condition: Callable[[], object],
    what: str,
    timeout_s: float = 60.0,
    every_s: float = POLL_S,
) -> None:
    """Wait (pausing the pilot) until ``condition()`` holds; ``what`` names it if it never does."""
    waited = 0.0
    while not condition():
        if waited >= timeout_s:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        await pilot.pause(every_s)
        waited += every_s


def transcript_shown(app: LocalChatApp) -> bool:
    """The open conversation's messages are the ones drawn on the chat screen (drawn for it:
    an empty log is not yet an empty conversation drawn)."""
    conversation = app.conversation
    if conversation is None or app.chat.transcript.conversation is not conversation:
        return False
    stored = [e.record.id for e in conversation.exchanges if e.record.role in ("user", "assistant")]
    return [entry.message_id for entry in app.chat.query(ChatEntry)] == stored


async def ready(pilot: Pilot, app: LocalChatApp, seen: list[Message]) -> None:
    """The model loaded, and a conversation open with its transcript drawn."""
    await wait_for(pilot, seen, ModelLoaded)
    await until(pilot, lambda: transcript_shown(app), "a conversation to open")


async def send(
    pilot: Pilot, seen: list[Message], *keys: str, timeout_s: float = 60.0
) -> ReplyFinished:
    """Press ``keys`` (they start a turn: Enter, Ctrl+R) and wait for the reply to be over and
    drawn."""
    mark = len(seen)
    await pilot.press(*keys)
    finished = await wait_for(pilot, seen, ReplyFinished, timeout_s, after=mark)
    app = pilot.app
    if isinstance(app, LocalChatApp):  # the chat screen has drawn it all
        await until(pilot, lambda: not app.chat.generating, "the reply to be drawn")
    return finished


async def say(pilot: Pilot, seen: list[Message], text: str) -> ReplyFinished:
    """Type ``text``, send it, and wait for the reply to be over and drawn."""
    return await send(pilot, seen, *text, "enter")


@dataclass
class ChatUI:
    """The running app, its pilot and every message posted in it so far (``seen``, in the
    order the app handled them)."""

    app: LocalChatApp
    pilot: Pilot[Any]
    seen: list[Message] = field(default_factory=list)

    async def wait_ready(self) -> None:
        """The model loaded, and a conversation open with its transcript drawn."""
        await ready(self.pilot, self.app, self.seen)

    async def say(self, text: str) -> ReplyFinished:
        """Type ``text``, send it, and wait for the reply to be over and drawn."""
        return await say(self.pilot, self.seen, text)

    async def send(self, *keys: str, timeout_s: float = 60.0) -> ReplyFinished:
        """Press ``keys`` that start a turn; wait for the reply to be over and drawn."""
        return await send(self.pilot, self.seen, *keys, timeout_s=timeout_s)

    async def wait_for(self, kind: type[M], after: int = 0, timeout_s: float = 60.0) -> M:
        """The first ``kind`` message posted since ``seen[after]``, waited for."""
        return await wait_for(self.pilot, self.seen, kind, timeout_s, after)

    async def until(self, condition: Callable[[], object], what: str, **wait: float) -> None:
        """Wait until ``condition()`` holds (``timeout_s``, ``every_s`` as ``until``)."""
        await until(self.pilot, condition, what, **wait)

    def posted(self, kind: type[M]) -> list[M]:
        """Every ``kind`` message posted so far."""
        return [m for m in self.seen if isinstance(m, kind)]

    def notifications(self) -> list[Notification]:
        """The notifications the app shows now (Textual keeps them in a private attribute:
        this is the one place the tests read it)."""
        return list(self.app._notifications)

    def notices(self) -> list[str]:
        """The texts of the notifications the app shows now."""
        return [n.message for n in self.notifications()]

    async def notice(self, *parts: str, timeout_s: float = 60.0) -> str:
        """Wait for a notification whose text holds every one of ``parts``; its text."""

        def found() -> str | None:
            return next((n for n in self.notices() if all(p in n for p in parts)), None)

        try:
            await self.until(found, f"a notice with {parts}", timeout_s=timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the notices: {self.notices()}") from None
        text = found()
        assert text is not None
        return text

    async def opened(self, before: ConversationBase | None) -> ConversationBase:
        """Wait until a conversation other than ``before`` is open and drawn; that one."""

        def other() -> bool:
            conversation = self.app.conversation
            opened = conversation is not None and conversation is not before
            return opened and transcript_shown(self.app)

        await self.until(other, "another conversation to open")
        assert self.app.conversation is not None
        return self.app.conversation

    async def shown(self, kind: type[S]) -> S:
        """Wait until a ``kind`` screen is on top, mounted (its widgets there, its focus
        asked for before any key pressed next); that screen."""
        await self.until(
            lambda: isinstance(self.app.screen, kind) and self.app.screen.is_mounted,
            f"the {kind.__name__}",
        )
        screen = self.app.screen
        assert isinstance(screen, kind)
        return screen

    def text(self, selector: str) -> str:
        """What the Static at ``selector`` on the screen shown shows."""
        return str(self.app.screen.query_one(selector, Static).render())


@asynccontextmanager
async def running(
    app: LocalChatApp, size: tuple[int, int] = (80, 24), ready: bool = True
) -> AsyncIterator[ChatUI]:
    """Run ``app`` (made by the test: patched first, say) in a terminal of ``size`` (Textual's
    default for tests); with ``ready``, wait until the model is loaded and a conversation
    open and drawn."""
    seen: list[Message] = []
    async with app.run_test(size=size, message_hook=seen.append) as pilot:
        ui = ChatUI(app, pilot, seen)
        if ready:
            await ui.wait_ready()
        yield ui


LAUNCH_FIELDS = {f.name for f in fields(LaunchOptions)}


@asynccontextmanager
async def chat_app(
    model: Path | None = None,
    *,
    size: tuple[int, int] = (80, 24),
    ready: bool = True,
    **options: Any,
) -> AsyncIterator[ChatUI]:
    """Run ``LocalChatApp(model, **options)``, greedy unless ``sampling`` is given, the
    launch options (``n_ctx``, ``template``, ...) gathered into one (see ``running`` for
    ``size`` and ``ready``)."""
    launch = {k: options.pop(k) for k in LAUNCH_FIELDS & options.keys()}
    app = LocalChatApp(model, LaunchOptions(**launch), **{"sampling": GREEDY, **options})
    async with running(app, size, ready) as ui:
        yield ui
