"""The first start, shown while it runs: each step (check, speed calibration, download) with
a bar and the time left. Esc skips the calibration (plans go by memory until it is measured)
or stops the download (it resumes next time)."""

from __future__ import annotations

import threading
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, ProgressBar, Static

from localchat.progress import Progress, StepProgress

SKIP_HINT = "Esc skips this step: plans go by memory until the speed is measured"
STOP_HINT = "Esc stops the download (it resumes where it left off next time)"


class StartupScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Skip or stop", id="startup-stop"),
    ]

    def __init__(self, cancel: threading.Event, skip: threading.Event) -> None:
        super().__init__(classes="dialog-screen")
        self.cancel = cancel
        self.skip = skip
        self.skippable = False
        self.step: StepProgress | None = None  # the step under way (a download is its last)
        self.plan = ""
        self._latest: StepProgress | Progress | None = None  # drawn once mounted

    def on_mount(self) -> None:
        self.show_plan(self.plan)
        if self._latest is not None:
            self.show(self._latest)

    def show(self, latest: StepProgress | Progress) -> None:
        """Draw a step's or a download's progress (kept until the screen is mounted)."""
        self._latest = latest
        if not self.is_mounted:
            return
        if isinstance(latest, StepProgress):
            self.show_step(latest)
        else:
            self.show_download(latest)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Getting a model ready", classes="dialog-title")
            yield Static("", id="startup-step")
            yield Static("", id="startup-plan")
            yield ProgressBar(total=1, id="startup-bar", show_eta=False)
            yield Static("", id="startup-status")
            yield Label(STOP_HINT, id="startup-hint", classes="dialog-hint")

    def show_step(self, step: StepProgress) -> None:
        """A step's progress (its bar runs 0..1)."""
        self.step = step
        self.skippable = step.skippable
        self.query_one("#startup-step", Static).update(Text(_step_title(step)))
        self.query_one(ProgressBar).update(total=1000, progress=round(1000 * step.fraction))
        left = f"about {step.eta_s:.0f} s left" if step.eta_s is not None else ""
        status = " · ".join(part for part in (step.detail, left) if part)
        self.query_one("#startup-status", Static).update(Text(status))
        self.query_one("#startup-hint", Label).update(SKIP_HINT if step.skippable else STOP_HINT)

    def show_download(self, progress: Progress) -> None:
        """A download's bytes (the last step of a first start, or the starter model)."""
        self.skippable = False
        title = f"Downloading {progress.name}"
        if self.step is not None and self.step.steps > 1:
            title = f"Step {self.step.steps} of {self.step.steps}: {title}"
        self.query_one("#startup-step", Static).update(Text(title))
        self.query_one(ProgressBar).update(
            total=max(1, progress.bytes_total), progress=progress.bytes_done
        )
        self.query_one("#startup-status", Static).update(Text(progress.summary()))
        self.query_one("#startup-hint", Label).update(STOP_HINT)

    def show_plan(self, text: str) -> None:
        """Which quant the planner chose for this machine, and why."""
        self.plan = text
        if self.is_mounted:
            self.query_one("#startup-plan", Static).update(Text(text))

    def action_stop(self) -> None:
        (self.skip if self.skippable else self.cancel).set()


def _step_title(step: StepProgress) -> str:
    title = step.title[:1].upper() + step.title[1:]
    return f"Step {step.step} of {step.steps}: {title}" if step.steps > 1 else title
