"""The app reads a message while it is typed: after Enter only the last few tokens are
evaluated, the panel says how many were read ahead and counts the first token from Enter,
and the reply is the one the same message gets typed fast or pasted (a real model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual import events

from localchat.cli.main import main
from localchat.paths import app_paths
from localchat.tui.messages import ConversationRestored, ReadAhead, ReplyFinished
from localchat.tui.widgets.prompt_input import PromptInput
from tests.tui_helpers import ChatUI, chat_app

QUESTION = "Write a Python function that returns the squares of a list of numbers, please."


def _keys(text: str) -> list[str]:
    return ["space" if ch == " " else ch for ch in text]


async def _send_typed(ui: ChatUI, text: str, pause_s: float) -> ReplyFinished:
    for key in _keys(text):
        await ui.pilot.press(key)
        if pause_s:  # a person typing: time between the keys, for reading ahead
            await ui.pilot.pause(pause_s)
    return await ui.send("enter")


async def _send_pasted(ui: ChatUI, text: str) -> ReplyFinished:
    box = ui.app.query_one(PromptInput)
    ui.app.post_message(events.Paste(text))  # as a terminal sends it: to the focused box
    await ui.pilot.pause()
    assert box.text == text
    return await ui.send("enter")


async def test_typed_slowly_fast_or_pasted_the_reply_is_the_same(smollm2: Path) -> None:
    results = {}
    async with chat_app(smollm2, size=(120, 36), n_ctx=1024, max_tokens=24) as ui:
        for way in ("slowly", "fast", "pasted"):
            previous = ui.app.conversation
            await ui.pilot.press("ctrl+n")
            await ui.opened(before=previous)
            await ui.say("Hi!")  # a warm conversation to read ahead after
            if way == "pasted":
                finished = await _send_pasted(ui, QUESTION)
            else:
                finished = await _send_typed(ui, QUESTION, 0.03 if way == "slowly" else 0)
            assert finished.turn.user_text == QUESTION
            stats = finished.turn.stats_dict() | {"prompt": finished.turn.prompt_tokens}
            results[way] = (finished.turn.reply_text, stats)
            if way == "slowly":
                panel = ui.text("#turn-start")
                speed = ui.text("#speed")
        assert any(m.tokens > 0 for m in ui.posted(ReadAhead))
    replies = {way: reply for way, (reply, _stats) in results.items()}
    assert replies["slowly"] == replies["fast"] == replies["pasted"] != ""
    slow = results["slowly"][1]
    assert slow["read_ahead_tokens"] > 10
    assert slow["prompt_tokens_evaluated"] < 12  # the last word and the template's cue
    assert slow["prompt"] == results["fast"][1]["prompt"] == results["pasted"][1]["prompt"]
    assert f"read {slow['read_ahead_tokens']} tokens ahead as you typed" in panel
    # The first-token figure counts from Enter: never less than the model's own part.
    assert slow["sent_ttft_s"] >= slow["ttft_s"] - 1e-6
    assert f"first token {slow['sent_ttft_s']:.2f} s" in speed


async def test_the_settings_turn_reading_ahead_and_restore_on_open_off(tiny_model: Path) -> None:
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text("type_ahead = false\nrestore_on_open = false\n")
    for _ in range(2):  # the second start opens a conversation with a saved cache
        async with chat_app(tiny_model, size=(120, 36), n_ctx=512, max_tokens=8) as ui:
            finished = await _send_typed(ui, "tell me about caches", 0.02)
            assert finished.turn.stats_dict()["read_ahead_tokens"] == 0
        assert not ui.posted(ReadAhead) and not ui.posted(ConversationRestored)


@pytest.mark.parametrize("line", ["type_ahead = 1", 'restore_on_open = "yes"'])
def test_a_setting_that_is_not_true_or_false_is_named(
    line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(line + "\n")
    assert main(["conversations"]) == 2
    name = line.split(" ")[0]
    assert f"setting {name} must be true or false" in capsys.readouterr().err


async def test_reading_ahead_that_fails_says_nothing_and_the_turn_says_why(
    tiny_model: Path,
) -> None:
    """A system prompt the context cannot hold: reading ahead gives up quietly (it is a
    bonus); Enter gives the one-line reason, and the message stays in the box."""
    async with chat_app(
        tiny_model, size=(120, 36), n_ctx=64, max_tokens=8, system_prompt="rule " * 80
    ) as ui:
        box, reader = ui.app.query_one(PromptInput), ui.app.chat.composer.reader
        for key in _keys("tell me about caches"):
            await ui.pilot.press(key)
        await ui.until(
            lambda: box.text == "tell me about caches" and not reader.running,
            "reading ahead to give up",
        )
        await ui.pilot.pause()  # one refresh: a notice posted as it ended is shown by now
        assert not ui.notices()  # nothing went wrong that the user must know yet
        await ui.pilot.press("enter")
        await ui.notice("cannot hold the system prompt")
        assert box.text == "tell me about caches"
