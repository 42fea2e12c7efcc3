"""Waiting helpers for pilot tests: the app works in threads, tests wait for its messages."""

from __future__ import annotations

from collections.abc import Callable

from textual.message import Message
from textual.pilot import Pilot

from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ModelLoaded, ReplyFinished


async def wait_for(
    pilot: Pilot, seen: list[Message], kind: type, timeout_s: float = 60.0, after: int = 0
) -> Message:
    waited = 0.0
    while waited < timeout_s:
        for message in seen[after:]:
            if isinstance(message, kind):
                return message
        await pilot.pause(0.05)
        waited += 0.05
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


async def until(
    pilot: Pilot, condition: Callable[[], bool], what: str, timeout_s: float = 60.0
) -> None:
    """Wait (pausing the pilot) until ``condition()`` holds."""
    waited = 0.0
    while not condition():
        if waited >= timeout_s:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        await pilot.pause(0.05)
        waited += 0.05


async def ready(pilot: Pilot, app: LocalChatApp, seen: list[Message]) -> None:
    await wait_for(pilot, seen, ModelLoaded)
    for _ in range(200):
        if app.conversation is not None:
            return
        await pilot.pause(0.05)
    raise AssertionError("no conversation opened")


async def say(pilot: Pilot, seen: list[Message], text: str) -> ReplyFinished:
    mark = len(seen)
    await pilot.press(*text, "enter")
    finished = await wait_for(pilot, seen, ReplyFinished, after=mark)
    assert isinstance(finished, ReplyFinished)
    app = pilot.app
    if isinstance(app, LocalChatApp):  # the chat screen has drawn it all
        await until(pilot, lambda: not app.chat.generating, "the reply to be drawn")
    return finished
