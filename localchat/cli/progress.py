"""Progress on stderr for the CLI's long steps: downloads, calibration, the benchmark."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from localchat.progress import Progress, StepProgress


@contextlib.contextmanager
def download_progress(
    json_lines: bool = False, out: TextIO | None = None
) -> Iterator[Callable[[Progress], None]]:
    """A download's progress on stderr: a redrawn line on a terminal, plain lines otherwise,
    or JSON lines on ``out``."""
    terminal = sys.stderr.isatty()
    last: dict[str, Any] = {"at": 0.0, "state": None, "drawn": False}

    def draw(progress: Progress) -> None:
        now = time.monotonic()
        changed = progress.state != last["state"]
        if not changed and now - last["at"] < (0.2 if terminal or json_lines else 2.0):
            return
        last.update(at=now, state=progress.state, drawn=True)
        if json_lines and out is not None:
            event = {
                "event": progress.state,
                "name": progress.name,
                "bytes_done": progress.bytes_done,
                "bytes_total": progress.bytes_total,
                "bytes_per_s": round(progress.speed, 1),
                "eta_s": None if progress.eta_s is None else round(progress.eta_s, 1),
            }
            out.write(json.dumps(event) + "\n")
            out.flush()
        elif terminal:
            sys.stderr.write(f"\r{progress.name}: {progress.summary()}   ")
            sys.stderr.flush()
        else:
            sys.stderr.write(f"{progress.name}: {progress.summary()}\n")
            sys.stderr.flush()

    try:
        yield draw
    finally:
        if last["drawn"] and terminal and not json_lines:
            sys.stderr.write("\n")


@contextlib.contextmanager
def step_progress(stream: TextIO) -> Iterator[Callable[[StepProgress], None]]:
    """A progress bar for a long step (calibration, a first start): one redrawn line on a
    terminal, else a plain line whenever the detail changes."""
    terminal = stream.isatty()
    last: dict[str, Any] = {"detail": "", "at": 0.0, "drawn": False}

    def draw(progress: StepProgress) -> None:
        now = time.monotonic()
        if terminal and now - last["at"] >= 0.1:
            filled = round(20 * progress.fraction)
            stream.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] {progress.line()}\x1b[K")
        elif not terminal and progress.detail != last["detail"]:
            stream.write(f"localchat: {progress.line()}\n")
        else:
            return
        stream.flush()
        last.update(detail=progress.detail, at=now, drawn=True)

    try:
        yield draw
    finally:
        if terminal and last["drawn"]:
            stream.write("\n")
            stream.flush()


def line_progress(stream: TextIO, label: str = "bench") -> Callable[[str], None]:
    """Each step of a long run as one line, ``label: line``."""

    def report(line: str) -> None:
        stream.write(f"{label}: {line}\n")
        stream.flush()

    return report
