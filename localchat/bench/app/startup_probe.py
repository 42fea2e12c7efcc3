"""``bench --only ui``'s ``startup_s``: the app started as the ``localchat`` command starts
it, exiting as soon as its first screen is up (``python -m localchat.bench.app.startup_probe
MODEL REPORT SPAWNED``, SPAWNED the parent's ``time.time()`` just before it started this process).
The start is the parent's clock, not the process's own creation time: Linux gives that in
clock ticks after a boot time kept in whole seconds, off by a constant 0-1 s per boot (0.41 s
on the boot where this was found, read as startup). A module of its own so that its process
imports what the command's does and no more: ``measure`` loads the engine and the stores for
its other figures, 0.1-0.2 s of imports the app itself leaves to a worker after the first
screen."""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

import localchat.cli.main  # noqa: F401  (what the command has imported when the app starts)
from localchat.tui.app import LocalChatApp


class StartupProbe(LocalChatApp):
    """Exits as soon as the first screen is up, writing how long that took to ``report``."""

    # Textual reads a relative CSS_PATH beside the module of the class it is set on, taken
    # as this subclass's: the app's stylesheet is named where it lies, in tui/.
    CSS_PATH = str(Path(inspect.getfile(LocalChatApp)).with_name(LocalChatApp.CSS_PATH))

    def __init__(self, model_path: Path, report: Path, spawned: float) -> None:
        super().__init__(model_path)
        self.report = report
        self.spawned = spawned

    def on_ready(self) -> None:  # the app's own starts the runtime; this one only times
        self.report.write_text(json.dumps({"startup_s": time.time() - self.spawned}))
        self.exit(0)


if __name__ == "__main__":
    StartupProbe(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])).run(headless=True)
