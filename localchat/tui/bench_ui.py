"""The app's figures for ``localchat bench --only ui``: startup time and streaming overhead.

- ``startup_s``: from the process's start to the first screen on display (the model loads
  afterwards, in a worker, and is not counted), measured in a fresh process.
- ``ui_cpu_overhead``: the extra CPU time of streaming a reply through the app (headless
  Textual, real widgets) over generating the same tokens without it, as a fraction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from textual import events

from localchat.conversation import Conversation
from localchat.engine import Engine, LoadOptions, Sampling
from localchat.kvstate import StateStore
from localchat.paths import HOME_ENV
from localchat.store import Store
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ReplyFinished

UI_TOKENS = 2000
UI_CTX = 4096
UI_ROUNDS = 3
MAIN_MODEL_TOKENS = 200
STARTUP_ROUNDS = 3
MESSAGE = "Tell me a long story about caches."


class _StartupProbe(LocalChatApp):
    """Exits as soon as the first screen is up, writing how long that took to ``report``."""

    def __init__(self, model_path: Path, report: Path) -> None:
        super().__init__(model_path)
        self.report = report

    def on_ready(self, _event: events.Ready) -> None:
        started = psutil.Process().create_time()
        self.report.write_text(json.dumps({"startup_s": time.time() - started}))
        self.exit(0)


def _startup_once(model_path: Path) -> float:
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        report = Path(tmp) / "startup.json"
        command = [
            sys.executable,
            "-m",
            "localchat.tui.bench_ui",
            "startup",
            str(model_path),
            str(report),
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if not report.exists():
            raise RuntimeError(f"startup probe failed: {result.stderr.strip()[-500:]}")
        return float(json.loads(report.read_text())["startup_s"])


def _headless_cpu(model_path: Path, max_tokens: int = UI_TOKENS) -> tuple[float, float, int]:
    """(CPU seconds, tokens/s, tokens) of the same turn with no UI: a conversation in a fresh store,
    so saving the transcript and the KV state costs the same on both sides."""
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        engine = Engine(model_path, LoadOptions(n_ctx=UI_CTX))
        store = Store(Path(tmp) / "db.sqlite3")
        conversation = Conversation.open(store, StateStore(Path(tmp) / "states"), "bench", engine)
        cpu = time.process_time()
        wall = time.perf_counter()
        turn = conversation.send(MESSAGE, Sampling(temperature=0.0), max_tokens)
        for _ in turn:
            pass
        conversation.saver.wait()
        cpu_used = time.process_time() - cpu
        tokens = turn.stats.generated_tokens
        rate = tokens / (time.perf_counter() - wall)
        conversation.close()
        store.close()
        engine.close()
    return cpu_used, rate, tokens


async def _app_cpu(model_path: Path, max_tokens: int = UI_TOKENS) -> tuple[float, int]:
    """CPU seconds of the same turn streamed through the app (send to reply finished)."""
    app = LocalChatApp(
        model_path, n_ctx=UI_CTX, max_tokens=max_tokens, sampling=Sampling(temperature=0.0)
    )
    finished: list[ReplyFinished] = []

    def hook(message: object) -> None:
        if isinstance(message, ReplyFinished):
            finished.append(message)

    async with app.run_test(size=(120, 36), message_hook=hook) as pilot:
        while app.conversation is None:
            await pilot.pause(0.05)
        app.query_one("#input").text = MESSAGE  # type: ignore[attr-defined]
        cpu = time.process_time()
        await pilot.press("enter")
        while not finished:
            await pilot.pause(0.01)
        assert app.conversation is not None
        app.conversation.saver.wait()
        await pilot.pause(0.2)  # the last chunk renders: part of the app's cost
        used = time.process_time() - cpu
        tokens = finished[0].stats.generated_tokens
    return used, tokens


@contextlib.contextmanager
def _scratch_home() -> Iterator[None]:
    """Run the app on an empty LOCALCHAT_HOME: the user's conversations stay untouched."""
    previous = os.environ.get(HOME_ENV)
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        os.environ[HOME_ENV] = tmp
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(HOME_ENV, None)
            else:
                os.environ[HOME_ENV] = previous


def _overhead(model_path: Path, max_tokens: int, rounds: int) -> tuple[float, float, int]:
    """(median overhead, median headless tokens/s, tokens) over ``rounds`` paired runs."""
    overheads, rates = [], []
    tokens = 0
    for _ in range(rounds):
        headless, rate, tokens = _headless_cpu(model_path, max_tokens)
        with _scratch_home():
            with_app, app_tokens = asyncio.run(_app_cpu(model_path, max_tokens))
        if app_tokens != tokens:
            raise RuntimeError(
                f"the app's reply had {app_tokens} tokens, headless {tokens}: not comparable"
            )
        overheads.append((with_app - headless) / headless)
        rates.append(rate)
    return statistics.median(overheads), statistics.median(rates), tokens


def bench_ui(tiny_model: Path, main_model: Path | None = None) -> dict[str, Any]:
    """Startup and overhead on the tiny model (thousands of tokens/s: the UI's worst case),
    and the overhead on ``main_model`` at its real speed, for scale."""
    startup = [_startup_once(tiny_model) for _ in range(STARTUP_ROUNDS)]
    overhead, rate, tokens = _overhead(tiny_model, UI_TOKENS, UI_ROUNDS)
    results: dict[str, Any] = {
        "ui_model": str(tiny_model),
        "ui_tokens": tokens,
        "ui_gen_tps": round(rate, 1),
        "ui_cpu_overhead": round(overhead, 4),
        "startup_s": round(statistics.median(startup), 3),
    }
    if main_model is not None:
        main_overhead, main_rate, main_tokens = _overhead(main_model, MAIN_MODEL_TOKENS, 1)
        results.update(
            {
                "ui_main_model": str(main_model),
                "ui_main_tokens": main_tokens,
                "ui_main_gen_tps": round(main_rate, 1),
                "ui_cpu_overhead_main_model": round(main_overhead, 4),
            }
        )
    return results


if __name__ == "__main__":  # the fresh process that ``_startup_once`` times
    if len(sys.argv) == 4 and sys.argv[1] == "startup":
        _StartupProbe(Path(sys.argv[2]), Path(sys.argv[3])).run(headless=True)
