"""Tools in the app: the MCP servers start beside the model, a call waits for the user's
consent (once, always here, or denied: the model is told), its result is shown as text and
the reply reads only it; the tools screen turns tools off."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest
from textual.widgets import SelectionList

from localchat.backends.compute_thread import run_compute
from localchat.conversation.base import ConversationBase
from localchat.tui.messages import ReplyFinished
from localchat.tui.screens.tool_consent import ToolConsentScreen
from localchat.tui.screens.tools import ToolsScreen
from localchat.tui.widgets.chat_message import ToolCallView
from tests.test_mcp import SERVER, mcp_settings, write_settings
from tests.tui_helpers import ChatUI, chat_app


async def _tools_offered(ui: ChatUI) -> ConversationBase:
    """The servers are up and the open conversation is offered their tools."""

    def offered() -> bool:
        conversation = ui.app.conversation
        return conversation is not None and conversation.tool_use is not None

    await ui.until(offered, "the tools to be offered")
    assert ui.app.conversation is not None
    return ui.app.conversation


async def test_a_server_that_answers_late_is_offered_from_then_on(
    tiny_model: Path, isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("localchat.tools.servers.START_TIMEOUT_S", 0.5)
    command = json.dumps([sys.executable, str(SERVER)])
    slow = (
        f'[[mcp]]\nname = "slow"\ncommand = {command}\nenv = {{ LOCALCHAT_TEST_MCP_DELAY = "2" }}\n'
    )
    write_settings(isolated_home, slow)
    async with chat_app(tiny_model) as ui:
        await ui.until(
            lambda: "MCP server 'slow' failed: no answer within 0 s" in ui.notices(),
            "the start to give up on it",
        )
        conversation = await _tools_offered(ui)
        assert conversation.tool_use is not None and "ping" in conversation.tool_use.names
        late = "MCP server 'slow' answered late: its tools are offered from now on"
        await ui.until(lambda: late in ui.notices(), "the notice that it answered")


async def _require(conversation: ConversationBase, name: str) -> None:
    """The next reply must call ``name`` (a grammar holds the random model to it)."""
    assert conversation.tool_use is not None
    forced = dataclasses.replace(conversation.tool_use, choice=name)
    await asyncio.to_thread(run_compute, conversation.offer_tools, forced)


async def _answer(ui: ChatUI, button: str) -> ToolConsentScreen:
    """Wait for the consent dialog, then press one of its buttons once presses count."""
    consent = await ui.shown(ToolConsentScreen)
    await ui.until(lambda: consent.armed, "the dialog to take answers")
    await ui.pilot.click(f"#{button}")
    return consent


async def _round_done(ui: ChatUI, replies_before: int) -> None:
    """The call's reply and the reply that read its result are both over and drawn."""
    await ui.until(
        lambda: len(ui.posted(ReplyFinished)) >= replies_before + 2 and not ui.app.chat.generating,
        "the reply after the tool's result",
    )


async def test_a_call_asks_runs_once_and_the_reply_reads_only_its_result(
    tiny_model: Path, isolated_home: Path
) -> None:
    write_settings(isolated_home, mcp_settings())
    async with chat_app(tiny_model, max_tokens=150) as ui:
        conversation = await _tools_offered(ui)
        await _require(conversation, "ping")
        await ui.pilot.press(*"ping", "enter")
        consent = await ui.shown(ToolConsentScreen)
        assert consent.call.name == "ping" and consent.server == "test"
        await _answer(ui, "once")
        await _round_done(ui, 0)
        (view,) = ui.app.chat.query(ToolCallView)
        assert (view.result, view.failed) == ("pong", False)
        roles = [e.record.role for e in conversation.exchanges]
        assert roles == ["user", "assistant", "tool", "assistant"]
        reading = ui.posted(ReplyFinished)[-1].stats
        assert 0 < reading.prompt_tokens_evaluated < 80  # the result and the cue only
        assert conversation.tool_use is not None and conversation.tool_use.choice == "auto"
        # Reopened, the transcript shows the call with its result.
        await ui.app.chat.show_transcript()
        (view,) = ui.app.chat.query(ToolCallView)
        assert view.result == "pong"


async def test_a_denied_call_tells_the_model_and_always_stops_asking(
    tiny_model: Path, isolated_home: Path
) -> None:
    write_settings(isolated_home, mcp_settings())
    async with chat_app(tiny_model, max_tokens=150) as ui:
        conversation = await _tools_offered(ui)
        await _require(conversation, "ping")
        await ui.pilot.press(*"one", "enter")
        await ui.shown(ToolConsentScreen)
        await ui.pilot.press("escape")  # deny
        await _round_done(ui, 0)
        result = conversation.exchanges[2].record
        assert (result.role, result.content) == ("tool", "error: the user did not allow this call")
        assert ui.app.chat.query(ToolCallView).last().failed
        # Always: the next call to it runs without asking.
        await _require(conversation, "ping")
        await ui.pilot.press(*"two", "enter")
        await _answer(ui, "always")
        await _round_done(ui, 2)
        await _require(conversation, "ping")
        await ui.pilot.press(*"three", "enter")
        await _round_done(ui, 4)
        assert not isinstance(ui.app.screen, ToolConsentScreen)
        assert [v.result for v in ui.app.chat.query(ToolCallView)][-2:] == ["pong", "pong"]


async def test_the_tools_screen_turns_a_tool_off(tiny_model: Path, isolated_home: Path) -> None:
    write_settings(isolated_home, mcp_settings())
    async with chat_app(tiny_model, max_tokens=8) as ui:
        conversation = await _tools_offered(ui)
        ui.app.action_tools()
        screen = await ui.shown(ToolsScreen)
        assert "ping" in screen.query_one("#tools-list", SelectionList).selected
        await ui.pilot.press("space")  # the first: ping, off
        await ui.pilot.press("escape")
        await ui.until(
            lambda: conversation.tool_use is not None and "ping" not in conversation.tool_use.names,
            "ping to be turned off",
        )
        await ui.notice("reads the conversation again")


async def test_quitting_while_a_call_waits_for_consent_answers_it_before_the_app_is_gone(
    tiny_model: Path, isolated_home: Path
) -> None:
    """The loop's thread waits on the dialog: quitting answers the dialog "deny", the call
    is answered as stopped (the model never reads a call without a result), and the app
    does not hang on a dialog that is gone."""
    from localchat.paths import app_paths
    from localchat.state.store import Store

    write_settings(isolated_home, mcp_settings())
    async with chat_app(tiny_model, max_tokens=150) as ui:
        conversation = await _tools_offered(ui)
        await _require(conversation, "ping")
        await ui.pilot.press(*"ping", "enter")
        await ui.shown(ToolConsentScreen)
        name = conversation.record.name
        await ui.pilot.press("ctrl+q")
    store = Store(app_paths().database)
    messages = store.messages(store.get(name).id)
    store.close()
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[-1].content.startswith("error:")
    assert messages[1].tool_calls and messages[1].tool_calls[0].id == messages[-1].tool_call_id
