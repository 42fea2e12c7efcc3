"""How often a streaming reply is redrawn: as often as reads smoothly, and never so often that
drawing slows the model down.

A frame (layout and render of the chat) costs the app's thread milliseconds of CPU, and on a
machine whose cores all run llama.cpp that time is taken from generation twice over: the
preempted worker's partner waits at llama.cpp's barrier meanwhile. So the app spends at most
``share`` of the generation's CPU time on drawing during a turn. On most machines that is never
the limit and replies stream at the chunk rate (10 a second); on a 2-core laptop running a
model at thousands of tokens/s, text arrives in fewer, larger steps instead of slowing it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# The worker posts text at most 10 times a second (reads as smooth streaming); chunks that
# reach the app closer together than half that (it was busy) make one frame.
MIN_INTERVAL_S = 0.1
FRAME_GAP_S = MIN_INTERVAL_S / 2
# The app's thread may use this fraction of the CPU time the generation threads use.
UI_CPU_SHARE = 0.02


@dataclass
class FramePacer:
    """Decides, per arriving chunk, whether to draw now or keep the text for a later frame.

    Created on the app's thread when a turn starts; ``thread_time`` there counts every frame
    the app draws, whatever triggered it. (Tests pass their own clocks.)
    """

    generation_threads: int
    share: float = UI_CPU_SHARE
    min_gap_s: float = FRAME_GAP_S
    wall_clock: Callable[[], float] = time.perf_counter
    cpu_clock: Callable[[], float] = time.thread_time
    started_wall: float = field(init=False)
    started_cpu: float = field(init=False)
    last_frame: float | None = field(init=False, default=None)
    # What the app's thread used from a frame's decision to the next chunk (the frame is drawn
    # in between): that frame's cost, the guess for the next one (a long paragraph costs more
    # each time). Measured once per frame, so that idle time does not count as drawing.
    _cpu_at_last_frame: float | None = field(init=False, default=None)
    _last_frame_cost: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.started_wall = self.wall_clock()
        self.started_cpu = self.cpu_clock()

    def ui_cpu_s(self) -> float:
        """CPU seconds the app's thread has used since the turn started."""
        return self.cpu_clock() - self.started_cpu

    def budget_s(self, now: float) -> float:
        """CPU seconds the app may have used by ``now``."""
        return self.share * self.generation_threads * (now - self.started_wall)

    def frame_due(self) -> bool:
        """True (and the frame counted) when drawing now keeps within both limits."""
        now = self.wall_clock()
        spent = self.ui_cpu_s()
        if self._cpu_at_last_frame is not None:
            self._last_frame_cost = spent - self._cpu_at_last_frame
            self._cpu_at_last_frame = None
        if self.last_frame is not None and now - self.last_frame < self.min_gap_s:
            return False
        if spent + self._last_frame_cost > self.budget_s(now):
            return False
        self.last_frame = now
        self._cpu_at_last_frame = spent
        return True
