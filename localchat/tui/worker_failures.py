"""One policy for a background worker that fails where it did not expect to."""

from __future__ import annotations

from textual.dom import DOMNode
from textual.worker import Worker, WorkerState

from localchat.errors import one_line


class ReportsWorkerFailures(DOMNode):
    """For the app and every screen that runs workers (all run with exit_on_error=False):
    a failure becomes a notice and the app goes on. Worker state messages do not bubble, so
    each node that starts workers takes this in."""

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state != WorkerState.ERROR:
            return
        error = event.worker.error
        what = event.worker.group or event.worker.name or "a background task"
        message = one_line(error) if error is not None else "unknown error"
        self.app.notify(f"{what} failed: {message}", severity="error", timeout=15)
        self.log.error(f"worker {what} failed", error)
