"""How far a long step has come (the first start's check, calibration, download), for the
app's start screen and the CLI's progress line alike. A leaf: plain data and its wording."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


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
