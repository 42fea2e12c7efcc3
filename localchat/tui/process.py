"""What the app does to the process it runs in: the signals that quit it, and the garbage
collector kept off what lives as long as the app."""

from __future__ import annotations

import gc
import signal
from collections.abc import Callable


def freeze_long_lived() -> None:
    """Move what is alive once the first model is up (modules, the app and its screens, the
    model's vocabulary) out of the garbage collector's reach. Otherwise every full collection
    walks all of it: one fell into the last frame of a fast reply and made a 16 ms frame take
    60, taken from generation on a 2-core machine. Objects frozen now that die later are
    still freed by their reference counts; only a cycle among them would stay."""
    gc.collect()
    gc.freeze()


def exit_on_signals(quit_app: Callable[[], None]) -> None:
    """SIGTERM and SIGHUP (the terminal closed) quit as Ctrl+Q does: the reply is kept."""
    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is not None:
            signal.signal(number, lambda _signum, _frame: quit_app())
