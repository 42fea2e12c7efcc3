"""What llama.cpp is told once per process, before it loads anything: where its log goes
(kept, not printed, so a failure can name its cause in one line) and whether its extra
weight buffers may be used. ``prepare`` does both, the first time an engine, a quantization
or a bare benchmark needs llama.cpp — importing this package changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
from collections import deque
from typing import Any

import llama_cpp

# llama.cpp's log lines, kept (not printed) so a failure can name its cause in one line.
_LOG_LINES: deque[str] = deque(maxlen=64)
_LOG_LOCK = threading.Lock()


# Lines where llama.cpp says what it allocated, kept whole from the last load.
_BUFFER_LINES: list[str] = []
_BUFFER_LINE_RE = re.compile(r"buffer size =|llama_kv_cache: size =")


@llama_cpp.llama_log_callback
def _capture_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", errors="replace")
    with _LOG_LOCK:
        _LOG_LINES.append(line)
        if _BUFFER_LINE_RE.search(line):
            _BUFFER_LINES.append(line)


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
