"""How far a long step has come (the first start's check, calibration, download) and how far a
download has, for the app's screens and the CLI's progress line alike. A leaf: plain data and
its wording."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from localchat.units import format_bytes


@dataclass(frozen=True)
class StepProgress:
    """One step of a multi-step start: where it is and how long it may take still."""

    title: str  # "measuring this machine's speed"
    fraction: float = 0.0  # 0..1 of this step
    detail: str = ""  # "Q4_K_M weights, round 1"
    eta_s: float | None = None
    step: int = 1
    steps: int = 1
    skippable: bool = False  # Esc skips it (calibration), rather than stopping the start

    def line(self) -> str:
        """``step 2/3 · measuring this machine's speed 45% (Q4_K_M weights), about 8 s left``"""
        head = f"step {self.step}/{self.steps} · " if self.steps > 1 else ""
        detail = f" ({self.detail})" if self.detail else ""
        left = f", about {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        return f"{head}{self.title} {100 * self.fraction:.0f}%{detail}{left}"


StepCallback = Callable[[StepProgress], object]


class Countdown:
    """Time left for ``total`` units of work from the pace of those done so far."""

    def __init__(self, total: float) -> None:
        self.total = max(total, 1e-9)
        self.started = time.monotonic()

    def eta_s(self, done: float) -> float | None:
        if done <= 0:
            return None
        elapsed = time.monotonic() - self.started
        return max(0.0, elapsed / done * (self.total - done))

    def fraction(self, done: float) -> float:
        return min(1.0, max(0.0, done / self.total))


@dataclass
class Progress:
    """One download's state for the UI and the CLI's progress bar."""

    name: str
    bytes_done: int = 0
    bytes_total: int = 0
    state: str = "queued"  # queued | downloading | verifying | done | failed | cancelled
    started_at: float = 0.0
    error: str = ""
    bytes_at_start: int = 0  # already on disk when this run began (a resumed download)

    @property
    def speed(self) -> float:
        """This run's transfer rate: bytes a resumed download already had do not count."""
        elapsed = time.monotonic() - self.started_at if self.started_at else 0.0
        return (self.bytes_done - self.bytes_at_start) / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        speed = self.speed
        return (self.bytes_total - self.bytes_done) / speed if speed > 0 else None

    def summary(self) -> str:
        """``downloading 45.0%: 120.0 MiB of 267.0 MiB at 12.3 MiB/s, 12 s left``"""
        percent = 100 * self.bytes_done / max(1, self.bytes_total)
        eta = f", {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        return (
            f"{self.state} {percent:.1f}%: {format_bytes(self.bytes_done)} of"
            f" {format_bytes(self.bytes_total)} at {format_bytes(self.speed)}/s{eta}"
        )


ProgressCallback = Callable[[Progress], object]
