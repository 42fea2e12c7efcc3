"""The machine and what runs on it: `localchat hw` in the app."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from localchat.errors import LocalchatError, one_line
from localchat.models.catalog import load_catalog
from localchat.models.draft_plan import with_catalog_drafts
from localchat.models.hardware import detect_hardware
from localchat.models.planner import MIN_TOKENS_PER_S, format_hardware_report, plan_catalog
from localchat.models.speed import load_speed_model
from localchat.paths import app_paths
from localchat.tui.worker_failures import ReportsWorkerFailures


class HardwareScreen(ReportsWorkerFailures, ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="hardware-close")
    ]

    def __init__(self, min_tps: float = MIN_TOKENS_PER_S) -> None:
        super().__init__(classes="dialog-screen")
        self.min_tps = min_tps  # the user's min_tokens_per_s setting

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Label("Hardware and plans", classes="dialog-title")
            yield Static("detecting…", id="hardware-report")
            yield Label("Esc closes", classes="dialog-hint")

    def on_mount(self) -> None:
        self.detect()

    @work(thread=True, exit_on_error=False, exclusive=True)
    def detect(self) -> None:
        hardware = detect_hardware()
        paths = app_paths()
        speed = load_speed_model(paths.speed_calibration)
        try:
            catalog = load_catalog(paths.user_catalog)
            plans = plan_catalog(catalog, hardware, speed=speed, min_tps=self.min_tps)
            plans = with_catalog_drafts(catalog, plans, hardware, speed)
        except (LocalchatError, OSError) as exc:  # a broken models.toml: say so, plan nothing
            plans = []
            report = format_hardware_report(hardware, plans, speed) + f"\n{one_line(exc)}\n"
        else:
            report = format_hardware_report(hardware, plans, speed)
        if speed is None:
            report += "\n(speeds not measured yet: `localchat hw` measures them once)\n"
        self.app.call_from_thread(self.query_one("#hardware-report", Static).update, Text(report))

    def action_close(self) -> None:
        self.dismiss(None)
