"""The first start's download, shown while it runs; Esc stops it (it resumes next time)."""

from __future__ import annotations

import threading
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, ProgressBar, Static

from localchat.hub import Progress


class DownloadScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop the download", id="download-stop"),
    ]

    def __init__(self, name: str, cancel: threading.Event, plan: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.model_name = name
        self.cancel = cancel
        self.plan = plan  # which quant the planner chose for this machine, and why

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(f"Downloading {self.model_name}", classes="dialog-title")
            yield Static(
                "The first model is being fetched from the hub. It is verified before it is used,"
                " and a stopped download resumes where it left off."
            )
            if self.plan:
                yield Static(Text(self.plan), id="startup-plan")
            yield ProgressBar(total=1, id="startup-bar", show_eta=False)
            yield Static("", id="startup-status")
            yield Label("Esc stops the download", classes="dialog-hint")

    def show(self, progress: Progress) -> None:
        self.query_one(ProgressBar).update(
            total=max(1, progress.bytes_total), progress=progress.bytes_done
        )
        self.query_one("#startup-status", Static).update(Text(progress.summary()))

    def action_stop(self) -> None:
        self.cancel.set()
