"""What llama.cpp is told once per process, before it loads anything: where its log goes
(kept, not printed, so a failure can name its cause in one line), whether its extra
weight buffers may be used, and how a load or a decode is stopped midway (``request_abort``).
``prepare`` installs them the first time an engine, a quantization or a bare benchmark needs
llama.cpp — importing this package changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
import weakref
from collections import deque
from typing import Any

import llama_cpp

# llama.cpp's log lines, kept (not printed) so a failure can name its cause in one line.
_LOG_LINES: deque[str] = deque(maxlen=64)
_LOG_LOCK = threading.Lock()
_LOGGED = [0]  # lines logged (less those forgotten): a position in the log


# Lines where llama.cpp says what it allocated, kept whole from the last load.
_BUFFER_LINES: list[str] = []
_BUFFER_LINE_RE = re.compile(r"buffer size =|llama_kv_cache: size =")


def _log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    try:
        line = text.decode("utf-8", errors="replace")
        with _LOG_LOCK:
            _LOG_LINES.append(line)
            _LOGGED[0] += 1
            if _BUFFER_LINE_RE.search(line):
                _BUFFER_LINES.append(line)
    except KeyboardInterrupt:
        # Raised here it would be printed as "Exception ignored" and lost: the load or the
        # decode that logged stops instead, and the engine raises it (see ``request_abort``).
        request_abort()


_capture_log = llama_cpp.llama_log_callback(_log_line)


# -- stopping llama.cpp midway ---------------------------------------------------------------
# One byte, set to stop whatever llama.cpp is doing (a load between two tensors, a decode
# between two graph nodes) and everything it would do next, until ``clear_abort``. Any thread
# may set it (a signal watcher does), while the main thread is inside llama.cpp.
_ABORT = ctypes.create_string_buffer(2)  # b"\0\0": go on; b"x\0": stop
_ABORT_ADDRESS = ctypes.addressof(_ABORT)


def request_abort() -> None:
    """Stop llama.cpp's work in progress and refuse more: an interrupted load or evaluation
    raises ``KeyboardInterrupt`` (safe from any thread)."""
    _write_stop_bytes(b"x")


def clear_abort() -> None:
    """Let llama.cpp work again."""
    _write_stop_bytes(b"\0")


def _write_stop_bytes(value: bytes) -> None:
    """The global stop byte and every context's own (``DecodeStop``) set to ``value``."""
    _ABORT[0] = value
    with _STOPS_LOCK:  # re-entrant: a second Ctrl+C's handler may run inside the first's
        stops = list(_STOPS)
    for stop in stops:
        stop.byte[0] = value


def abort_requested() -> bool:
    return _ABORT.raw[0] != 0


def _abort_callback() -> Any:
    """llama.cpp's abort callback, asked after every graph node of a decode. A Python callback
    would take the GIL hundreds of times per token (a third slower here, and behind any busy
    Python thread), so it is C's ``strlen`` on the abort byte: 0 (go on) or 1 (stop), read
    without Python. A Python function only where there is no C library to take it from."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
    except (OSError, AttributeError):  # no process-wide C library (Windows)
        address = None
    if address is None:
        return llama_cpp.llama_cpp.ggml_abort_callback(_abort_in_python)
    return llama_cpp.llama_cpp.ggml_abort_callback(address)


def _abort_in_python(user_data: int | None) -> bool:
    """The stop byte at ``user_data`` (the global one or a context's ``DecodeStop``)."""
    if not user_data:
        return False
    return ctypes.string_at(user_data, 1) != b"\0"


_ABORT_CALLBACK = _abort_callback()


class DecodeStop:
    """A context's own stop byte, for stopping its decode in flight and no other work (the
    server's scheduler: a step given up so that a new request joins the next one at once);
    ``request_abort`` sets it too, so Ctrl+C stops that context as it stops every other."""

    def __init__(self) -> None:
        self.byte = ctypes.create_string_buffer(2)  # as ``_ABORT``: b"x" stops
        with _STOPS_LOCK:
            _STOPS.add(self)
        if abort_requested():
            self.byte[0] = b"x"

    def set(self) -> None:
        """Stop the context's decode in flight (any thread); ``clear`` before the next."""
        self.byte[0] = b"x"

    def clear(self) -> None:
        """Let the context decode again, unless all of llama.cpp's work is to stop (asked
        after the write: a ``request_abort`` meanwhile is not lost)."""
        self.byte[0] = b"\0"
        if abort_requested():
            self.byte[0] = b"x"

    @property
    def is_set(self) -> bool:
        return self.byte.raw[0] != 0


_STOPS: weakref.WeakSet[DecodeStop] = weakref.WeakSet()
_STOPS_LOCK = threading.RLock()


def watch_abort(ctx: Any, stop: DecodeStop | None = None) -> None:
    """Make ``request_abort`` stop this context's decodes between two graph nodes (and
    ``stop``, where given, stop them on its own)."""
    address = _ABORT_ADDRESS if stop is None else ctypes.addressof(stop.byte)
    llama_cpp.llama_set_abort_callback(ctx, _ABORT_CALLBACK, ctypes.c_void_p(address))


def _load_step(progress: float, user_data: ctypes.c_void_p) -> bool:
    """Asked between two tensors of a load: False stops it."""
    try:
        return not abort_requested()
    except KeyboardInterrupt:  # as in the log callback: it stops the load, not lost
        request_abort()
        return False


_LOAD_PROGRESS = llama_cpp.llama_cpp.llama_progress_callback(_load_step)

# The Python functions llama.cpp calls back into: an exception raised in one of their frames
# is lost (ctypes prints it and returns), so a SIGINT handler must not raise there.
CALLBACK_CODES = frozenset(
    f.__code__ for f in (_log_line, _load_step, _abort_in_python, abort_requested)
)


def log_position() -> int:
    """Where llama.cpp's log is now, for ``forget_log_since``."""
    with _LOG_LOCK:
        return _LOGGED[0]


def forget_log_since(position: int) -> None:
    """Drop the lines logged since ``position``: what llama.cpp says of a decode stopped on
    purpose (three "failed" lines, the cells it removed) would otherwise be the cause that
    ``last_error_line`` names for the next real failure."""
    with _LOG_LOCK:
        for _ in range(min(_LOGGED[0] - position, len(_LOG_LINES))):
            _LOG_LINES.pop()
        _LOGGED[0] = min(_LOGGED[0], position)


def last_error_line() -> str:
    """The most telling line llama.cpp logged: its innermost error, without the call site."""
    with _LOG_LOCK:
        lines = [line.strip() for line in _LOG_LINES if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
    if not errors:
        return lines[-1] if lines else "no details from llama.cpp"
    # The first error is the cause; later ones are callers reporting that it failed.
    return re.sub(r"^(\w+: )+", "", errors[0])


# llama.cpp's "extra" weight buffers (repacked layouts, Intel AMX tiles) are on unless a
# self-test in a child process crashed: on some machines that report AMX (virtual machines
# among them) its AMX matrix kernel segfaults on the first decode. The verdict is kept in
# the environment, so processes started from this one do not test again.
EXTRA_BUFFERS_ENV = "LOCALCHAT_EXTRA_BUFFERS"
_DEFAULT_MODEL_PARAMS = llama_cpp.llama_cpp.llama_model_default_params


def extra_buffers_allowed() -> bool:
    """Whether llama.cpp may use its extra weight buffer types here (tested once)."""
    verdict = os.environ.get(EXTRA_BUFFERS_ENV)
    if verdict not in ("0", "1"):
        if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
            verdict = "1"
        else:
            verdict = "1" if _extra_buffers_survive() else "0"
        os.environ[EXTRA_BUFFERS_ENV] = verdict
    return verdict == "1"


def _extra_buffers_survive() -> bool:
    """Run one decode of a tiny Q8_0 model with the extra buffers on, in a child process."""
    code = (
        "import sys, tempfile, pathlib\n"
        "from localchat.models.demo import make_demo_model\n"
        "from localchat.backends.llama.tools import bare_generation_benchmark\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    path = make_demo_model(pathlib.Path(d) / 'probe.gguf', 'tiny', 'Q8_0')\n"
        "    bare_generation_benchmark(path, 64, 8, 3, 1)\n"
    )
    env = {**os.environ, EXTRA_BUFFERS_ENV: "1"}
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    # Killed by a signal (the segfault) is the verdict; a child that failed otherwise (an
    # import, the disk) says nothing against the buffers.
    return result.returncode >= 0


def _model_params() -> Any:
    """llama.cpp's default model parameters, with the extra buffers off where they crash."""
    params = _DEFAULT_MODEL_PARAMS()
    if not extra_buffers_allowed():
        params.use_extra_bufts = False
    params.progress_callback = _LOAD_PROGRESS  # a load stops between tensors on request
    return params


_PREPARED = False
_PREPARE_LOCK = threading.Lock()


def prepare() -> None:
    """Install the log capture and the model-parameter guard (once per process)."""
    global _PREPARED
    with _PREPARE_LOCK:
        if _PREPARED:
            return
        llama_cpp.llama_log_set(_capture_log, ctypes.c_void_p(0))
        # llama-cpp-python's ``Llama`` asks for these defaults when it loads a model.
        llama_cpp.llama_cpp.llama_model_default_params = _model_params
        _PREPARED = True


def start_capture() -> None:
    """Forget earlier log lines: what follows is one load's."""
    with _LOG_LOCK:
        _LOG_LINES.clear()
        _BUFFER_LINES.clear()


def buffer_lines() -> list[str]:
    """The lines where llama.cpp said what it allocated, since ``start_capture``."""
    with _LOG_LOCK:
        return list(_BUFFER_LINES)
