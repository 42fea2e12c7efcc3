"""Ctrl+C in the CLI: whatever a command is doing, it stops within a second with exit code 130
and one line, never a traceback.

Python's own handler raises ``KeyboardInterrupt`` wherever the main thread is, and two places
go wrong: a ctypes callback (llama.cpp's log during a load), where ctypes prints the exception
as "Exception ignored" and drops it, and native code that holds the main thread (a long
prompt decode), where no Python runs until it returns. So this module's policy:

- The handler notes the interrupt and asks llama.cpp to stop (``runtime.request_abort``, when
  the llama backend is loaded). It raises ``KeyboardInterrupt`` at once, unless the main thread
  is inside llama-cpp-python or one of the backend's callbacks: there the abort stops the work
  (a load between two tensors, a decode between two graph nodes) and the engine raises
  ``KeyboardInterrupt`` when control is back in Python.
- A watcher thread, woken through the signal's wakeup fd, asks for the abort at once: a decode
  that holds the main thread stops without waiting for Python to run there.
- The entry point installs this before the command's heavy imports. Outside ``run``'s command
  (before it starts, after it returns) a Ctrl+C leaves at once, and so does a second one
  while the first is being handled; a command that ends after a Ctrl+C (one that landed
  where it could not be raised) still exits 130.

This module imports only the standard library's lightest parts: it runs before everything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

TYPE_CHECKING = False  # not ``typing``'s: that import alone costs this module 10 ms
if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from types import CodeType, FrameType

EXIT_INTERRUPTED = 130
# The llama backend's runtime: never imported from here (it loads llama.cpp), only asked to
# stop when something else loaded it.
_RUNTIME = "localchat.backends.llama.runtime"

_interrupted = threading.Event()
_handled = 0  # SIGINTs the handler has seen (the main thread only)
# Whether ``run`` is inside the command: before it (the entry point's import) and after it
# (Python shutting down) there is nothing to clean up, and a raised interrupt is a traceback.
_running = False
_installed = False


def install() -> None:
    """Take over SIGINT for this process (from the main thread, before the heavy imports)."""
    global _installed
    if _installed:
        return
    signal.signal(signal.SIGINT, _on_sigint)
    if sys.platform != "win32":
        _watch_wakeups()
    _installed = True


def uninstall() -> None:
    """Give SIGINT back to Python's default (for the app, whose own loop handles it)."""
    global _installed
    if not _installed:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.platform != "win32":
        signal.set_wakeup_fd(-1)
    _installed = False


def interrupted() -> bool:
    """Whether Ctrl+C was pressed since ``install``."""
    return _interrupted.is_set()


def run(command: Callable[[], int]) -> int:
    """Run the CLI's ``command`` under this policy; its exit code, or 130 after a Ctrl+C."""
    global _running
    install()
    try:
        _running = True  # in here: a KeyboardInterrupt raised now is caught below
        code = command()
        _running = False
    except KeyboardInterrupt:  # while importing, before the command's own handling
        _running = False
        _say("localchat: interrupted\n")
        code = EXIT_INTERRUPTED
    _running = False
    return EXIT_INTERRUPTED if interrupted() else code


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _handled
    _handled += 1
    _note()
    if not _running or _handled > 1:
        _leave()
    if _inside_llama(frame):
        return  # the abort stops that work; the engine raises KeyboardInterrupt after it
    raise KeyboardInterrupt


def _note() -> None:
    """Record the interrupt and stop llama.cpp's work (any thread)."""
    _interrupted.set()
    runtime = sys.modules.get(_RUNTIME)
    request_abort = getattr(runtime, "request_abort", None)
    if request_abort is not None:
        request_abort()


def _inside_llama(frame: FrameType | None) -> bool:
    """Whether the main thread is in llama-cpp-python (objects half built, counts half
    updated) or in a callback from llama.cpp (an exception there is lost)."""
    if "llama_cpp" not in sys.modules:
        return False
    callbacks: Collection[CodeType] = getattr(sys.modules.get(_RUNTIME), "CALLBACK_CODES", ())
    while frame is not None:
        if frame.f_code in callbacks:
            return True
        module = str(frame.f_globals.get("__name__", ""))
        in_llama_cpp = module == "llama_cpp" or module.startswith("llama_cpp.")
        if in_llama_cpp and frame.f_code.co_name != "<module>":  # an import may stop anywhere
            return True
        frame = frame.f_back
    return False


def _leave() -> None:
    """Exit now: the user asked twice, or no command is running to stop cleanly."""
    _say("localchat: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def _say(text: str) -> None:
    """One line on stderr, written past Python's buffers (safe inside a signal handler)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def _watch_wakeups() -> None:
    """A thread that learns of each SIGINT as it arrives (Python's C handler writes the signal
    number to the wakeup fd) and stops llama.cpp while the main thread is still inside it."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), name="sigint-watcher", daemon=True).start()


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            _note()
