"""SVG snapshots of the chat, models and conversations screens (pytest-textual-snapshot).

Figures that change from run to run (timings, process memory, dates) are set to fixed text
before the screenshot; everything else is the real app on the tiny model. Update with
``pytest tests/test_snapshots.py --snapshot-update`` and review the SVGs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.text import Text
from textual.pilot import Pilot
from textual.widgets import DataTable, Sparkline, Static

from localchat.backends.llama.engine import Engine
from localchat.models.hardware import Hardware
from localchat.models.launch import LaunchOptions
from localchat.tui.app import LocalChatApp
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.models import ModelsScreen
from localchat.tui.widgets.chat_message import AssistantMessage
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel
from tests.conftest import GREEDY
from tests.tui_helpers import transcript_shown, until

SIZE = (120, 36)
GIB = 1024**3
FIXED_TIME = 1_767_225_600.0  # 2026-01-01 00:00 UTC


async def _settle(pilot: Pilot, app: LocalChatApp, replies: int = 0) -> None:
    """Until the conversation is open and drawn with ``replies`` stored replies, and no reply
    is under way."""

    def settled() -> bool:
        stored = [r for r in app.query(AssistantMessage) if r.message_id is not None]
        return transcript_shown(app) and len(stored) == replies and not app.chat.generating

    await until(pilot, settled, "the chat to settle")


def _freeze_figures(app: LocalChatApp) -> None:
    screen = app.screen_stack[0]
    screen.query_one(PromptInput).cursor_blink = False
    screen.query_one("#speed", Static).update(
        Text("gen 100.0 tok/s\nprompt 1000.0 tok/s\nfirst token 0.01 s")
    )
    screen.query_one("#turn-start", Static).update(Text("evaluated 10 tokens in 0.01 s"))
    screen.query_one("#ram", Static).update(Text("process 100.0 MiB\nfree RAM 20.0 GiB"))
    screen.query_one(Sparkline).data = [1.0, 2.0, 3.0]


@pytest.fixture(autouse=True)
def _fixed_memory_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The panel re-reads process memory every second; in a snapshot it shows fixed text
    (a refresh between freezing the figures and the screenshot made the test flaky)."""

    def fixed(panel: StatsPanel) -> None:
        panel.query_one("#ram", Static).update(Text("process 100.0 MiB\nfree RAM 20.0 GiB"))

    monkeypatch.setattr(StatsPanel, "refresh_memory", fixed)
    # llama.cpp lays weights out by the CPU's features (repacked for AVX2, AMX tiles, or
    # not at all where those crash): the weights buffer differs from machine to machine.
    monkeypatch.setattr(
        Engine,
        "buffers_summary",
        lambda _engine: "weights 450.6 KiB · compute 6.5 MiB · no flash attention",
    )


def _app(model: Path, name: str = "snapshot") -> LocalChatApp:
    return LocalChatApp(
        model, LaunchOptions(n_ctx=512), max_tokens=24, sampling=GREEDY, conversation_name=name
    )


def test_chat_screen(snap_compare, tiny_model: Path) -> None:
    app = _app(tiny_model)

    async def run_before(pilot: Pilot) -> None:
        await _settle(pilot, app)
        await pilot.press(*"Hello, what is a KV cache?", "enter")
        await _settle(pilot, app, replies=1)
        _freeze_figures(app)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_conversations_screen(snap_compare, tiny_model: Path) -> None:
    app = _app(tiny_model, "trip planning")

    async def run_before(pilot: Pilot) -> None:
        await _settle(pilot, app)
        assert app.store is not None and app.states is not None
        for name in ("groceries", "kv cache notes"):
            app.store.create_conversation(name, model="tiny-Q4_K_M.gguf")
        app.store.db.execute(
            "UPDATE conversations SET updated_at = ?, created_at = ?", (FIXED_TIME, FIXED_TIME)
        )
        _freeze_figures(app)
        screen = ConversationsScreen(app.store, app.states, "trip planning")
        await app.push_screen(screen)
        listed = len(app.store.conversations())
        table = screen.query_one(DataTable)
        await until(pilot, lambda: table.row_count == listed, "the conversations to be listed")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_models_screen(snap_compare, tiny_model: Path) -> None:
    from localchat.models.speed import SpeedModel, machine_name
    from localchat.paths import app_paths

    app = _app(tiny_model)
    laptop = Hardware(16 * GIB, 12 * GIB, 8)
    # Fixed costs per byte (a calibration's figures vary by run): the speeds shown are stable.
    costs = {"F16": 3.7e-11, "Q8_0": 5e-11, "Q6_K": 7e-11, "Q4_K": 5.2e-11, "Q2_K": 7.4e-11}
    SpeedModel(costs, 1e-4, costs, 1e-5, machine_name(), 8).save(app_paths().speed_calibration)

    async def run_before(pilot: Pilot) -> None:
        await _settle(pilot, app)
        _freeze_figures(app)
        screen = ModelsScreen(hardware=laptop)
        await app.push_screen(screen)
        # Listed, and the highlighted model's plan shown under the table.
        status = screen.query_one("#download-status", Static)
        await until(pilot, lambda: str(status.render()), "the models and a plan")
        table = screen.query_one(DataTable)
        await until(pilot, lambda: table.row_count == len(screen.rows) > 0, "every row")

        def laid_out() -> bool:  # the columns sized to the rows (on idle: later when busy)
            widths = [column.content_width for column in table.columns.values()]
            return not table._new_rows and widths[0] >= len(screen.rows[0].model)

        await until(pilot, laid_out, "the table laid out")
        # ...and drawn so: once in a full suite the screenshot still showed the columns at
        # their first widths ("qwen2" for the model) though the table had measured its rows.
        model = screen.rows[0].model
        await until(pilot, lambda: model in app.export_screenshot(), "the table drawn laid out")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
