"""Every llama.cpp computation of a long-running process happens on one long-lived thread.

llama.cpp's CPU backend (built with OpenMP) keeps a pool of worker threads for each thread that
calls into it, for as long as that thread lives. When callers take turns on several threads (a
thread pool's workers do), several pools stay alive; once they hold more threads than the
machine has CPUs, OpenMP stops spinning between steps and generation runs several times slower
(measured on 2 cores: 3,600 tokens/s on one thread, 600 after the model was loaded on another).
One thread, one pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_LOCAL = threading.local()
COMPUTE_THREAD_PREFIX = "llama-compute"  # its name (the bench tells its CPU from the app's)


def _mark_compute_thread() -> None:
    _LOCAL.is_compute_thread = True


_EXECUTOR = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix=COMPUTE_THREAD_PREFIX, initializer=_mark_compute_thread
)
# Calls submitted and not yet started: background work (reading ahead) yields to them.
_waiting = 0
_WAITING_LOCK = threading.Lock()


def run_compute(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``function`` on the compute thread and wait for it; its exception is raised here.

    Called from the compute thread itself, it runs in place (no deadlock)."""
    global _waiting
    if on_compute_thread():
        return function(*args, **kwargs)

    def started() -> T:
        global _waiting
        with _WAITING_LOCK:
            _waiting -= 1
        return function(*args, **kwargs)

    with _WAITING_LOCK:
        _waiting += 1
    try:
        future = _EXECUTOR.submit(started)
    except BaseException:
        with _WAITING_LOCK:
            _waiting -= 1
        raise
    return future.result()


def start_compute(function: Callable[[], None]) -> None:
    """Start ``function`` on the compute thread and return at once (a server's scheduling
    loop, which runs while it has sequences and takes new ones between its steps). Until it
    starts it counts as waiting (``compute_waiting``): another model's loop gives way."""
    global _waiting

    def started() -> None:
        global _waiting
        with _WAITING_LOCK:
            _waiting -= 1
        function()

    with _WAITING_LOCK:
        _waiting += 1
    try:
        _EXECUTOR.submit(started)
    except BaseException:
        with _WAITING_LOCK:
            _waiting -= 1
        raise


def wait_idle(timeout_s: float) -> bool:
    """Wait until what the compute thread runs now, and what waits for it, is done (quitting
    lets background work finish its step before the stores close); False on timeout."""
    if on_compute_thread():
        return True
    try:
        _EXECUTOR.submit(lambda: None).result(timeout_s)
    except TimeoutError:
        return False
    return True


def compute_waiting() -> bool:
    """Whether another call waits for the compute thread: work that can stop early (reading
    a message ahead while it is typed) checks this between small steps and gives way."""
    return _waiting > 0


def on_compute_thread() -> bool:
    """True on the compute thread."""
    return bool(getattr(_LOCAL, "is_compute_thread", False))
