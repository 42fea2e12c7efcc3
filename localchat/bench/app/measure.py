"""The app's figures for ``localchat bench --only ui``: startup time and streaming overhead.

- ``startup_s``: from the process's start to the first screen on display (the model loads
  afterwards, in a worker, and is not counted), measured in fresh processes: the steady
  least of them (``bench.common.steady_least``: a shared host's neighbours only add to it).
- ``ui_cpu_overhead``: the extra CPU time of streaming a reply through the app (headless
  Textual, real widgets) over generating the same tokens without it, as a fraction: the CPU
  of the threads other than generation's (the compute thread and llama.cpp's workers, the
  same work on both sides) in the app over those in the headless run, against the headless
  run's whole CPU. ``ui_process_cpu_overhead`` beside it counts the whole process, the
  generation threads too: their seconds vary by ±10% between two processes here with the
  host's speed (a pair swung by ±0.15 on the main model), which decides that figure more
  than the app does (the app's own threads take ~0.1 s of a 3 s turn). Not counted: the
  app's worker gathering the text on the compute thread (a string append a token, a post
  every 0.1 s: microseconds); what its posts cost the app's thread is counted there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
from textual import events

from localchat.backends.base import Sampling
from localchat.backends.compute_thread import COMPUTE_THREAD_PREFIX, run_compute
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.bench.common import steady_least
from localchat.conversation.local import Conversation
from localchat.models.launch import LaunchOptions
from localchat.paths import HOME_ENV
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ConversationRestored, ModelLoaded, ReplyFinished

# The tiny model answers this with 3,000 tokens (no early end of text) at thousands of
# tokens/s: the app's hardest case, and long enough that one turn's fixed costs do not decide.
UI_TOKENS = 3000
UI_CTX = 4096
UI_ROUNDS = 7
MAIN_MODEL_TOKENS = 64  # ~2.3 s at the 0.5b shape's speed: the app's fixed costs still small (3%)
# A single pair on this model swings by ±0.15 (the machine's speed drifts between processes);
# the median of this many agrees between runs.
MAIN_MODEL_ROUNDS = 7
STARTUP_ROUNDS = 5  # fresh processes; the steady least of them (0.87-1.24 s over three runs of 3)
MESSAGE = "Write a long essay about memory."
SETTLE_S = 0.5
WAIT_LIMIT_S = 120.0


def _startup_once(model_path: Path) -> float:
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        report = Path(tmp) / "startup.json"
        command = [sys.executable, "-m", "localchat.bench.app.startup_probe", str(model_path)]
        command += [str(report), repr(time.time())]  # the start: this clock, just before
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if not report.exists():
            raise RuntimeError(f"startup probe failed: {result.stderr.strip()[-500:]}")
        return float(json.loads(report.read_text())["startup_s"])


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds of the process, and of its generation threads among them: the compute
    thread and llama.cpp's workers (native threads Python does not know)."""

    total: float
    generation: float

    @property
    def other(self) -> float:
        """What the rest (the app's event loop, savers, Textual) used."""
        return self.total - self.generation

    def __sub__(self, before: CpuSplit) -> CpuSplit:
        return CpuSplit(self.total - before.total, self.generation - before.generation)


def _cpu_split() -> CpuSplit:
    """This process's CPU now (threads that ended count in the total, as the app's)."""
    named = {thread.native_id: thread.name for thread in threading.enumerate()}
    generation = 0.0
    for thread in psutil.Process().threads():
        name = named.get(thread.id)
        if name is None or name.startswith(COMPUTE_THREAD_PREFIX):
            generation += thread.user_time + thread.system_time
    return CpuSplit(time.process_time(), generation)


def _headless_cpu(model_path: Path, max_tokens: int) -> tuple[CpuSplit, float, int]:
    """(CPU seconds, tokens/s, tokens) of the turn with no UI: a conversation in a fresh store,
    so saving the transcript and the KV state costs the same on both sides. It runs on the
    compute thread, as the app's turns do."""
    return run_compute(_headless_turn, model_path, max_tokens)


def _headless_turn(model_path: Path, max_tokens: int) -> tuple[CpuSplit, float, int]:
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        engine = Engine(model_path, LoadOptions(n_ctx=UI_CTX))
        store = Store(Path(tmp) / "db.sqlite3")
        conversation = Conversation.open(store, StateStore(Path(tmp) / "states"), "bench", engine)
        cpu = _cpu_split()
        wall = time.perf_counter()
        reply = conversation.send(MESSAGE, Sampling(temperature=0.0), max_tokens)
        for _ in reply:
            pass
        conversation.wait_saved()
        cpu_used = _cpu_split() - cpu
        tokens = reply.stats.generated_tokens
        rate = tokens / (time.perf_counter() - wall)
        conversation.close()
        store.close()
        engine.close()
    return cpu_used, rate, tokens


async def _app_cpu(model_path: Path, max_tokens: int) -> tuple[CpuSplit, float, int]:
    """(CPU seconds, tokens/s, tokens) of the same turn streamed through the app, from Enter
    to the reply drawn; the app has settled after loading before the clock starts. The test
    side waits on events, not by polling the pilot (each poll visits every widget)."""
    app = LocalChatApp(
        model_path,
        LaunchOptions(n_ctx=UI_CTX),
        max_tokens=max_tokens,
        sampling=Sampling(temperature=0.0),
    )
    watch = _AppEvents()
    done, finished = watch.done, watch.finished
    async with app.run_test(size=(120, 36), message_hook=watch.hook) as pilot:
        await _wait(watch.loaded, "the model to load")
        # Both sides evaluate the whole prompt in the turn: nothing is read ahead of Enter.
        app.settings = replace(app.settings, type_ahead=False)
        await pilot.pause(SETTLE_S)  # the conversation opens, the screen settles
        app.query_one("#input").text = MESSAGE  # type: ignore[attr-defined]
        await pilot.pause(SETTLE_S)
        cpu = _cpu_split()
        _press_enter(app)
        await _wait(done, "the reply")
        assert app.conversation is not None
        app.conversation.wait_saved()
        await asyncio.sleep(0.1)  # the last frame is drawn: part of the app's cost
        used = _cpu_split() - cpu
        stats = finished[0].stats
    return used, stats.gen_tps, stats.generated_tokens


class _AppEvents:
    """What a measurement waits for in the app: the model loaded, a conversation restored,
    each reply finished (the test side waits on these, never polling the pilot)."""

    def __init__(self) -> None:
        self.loaded, self.restored, self.done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.finished: list[ReplyFinished] = []

    def hook(self, message: object) -> None:
        if isinstance(message, ModelLoaded):
            self.loaded.set()
        elif isinstance(message, ConversationRestored):
            self.restored.set()
        elif isinstance(message, ReplyFinished):
            self.finished.append(message)
            self.done.set()


def _press_enter(app: LocalChatApp) -> None:
    """Enter, delivered as a terminal's driver delivers it: the key is posted and that is all.
    (``pilot.press`` then polls until the process goes idle, which it does not while a reply
    is generated: the polling would be counted as the app's cost and take the model's cores.)"""
    app.post_message(events.Key("enter", "\r"))


async def _wait(event: asyncio.Event, what: str) -> None:
    try:
        await asyncio.wait_for(event.wait(), WAIT_LIMIT_S)
    except TimeoutError:
        raise RuntimeError(f"the app did not show {what} within {WAIT_LIMIT_S:.0f} s") from None


@contextlib.contextmanager
def _scratch_home(copy_of: Path | None = None) -> Iterator[None]:
    """Run the app on a LOCALCHAT_HOME of its own — empty, or a copy of ``copy_of`` (used up
    by the run): the user's conversations stay untouched."""
    previous = os.environ.get(HOME_ENV)
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        home = Path(tmp) / "home"
        if copy_of is None:
            home.mkdir()
        else:
            shutil.copytree(copy_of, home)
        os.environ[HOME_ENV] = str(home)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(HOME_ENV, None)
            else:
                os.environ[HOME_ENV] = previous


async def _first_turns_after_open(
    model_path: Path, name: str, messages: tuple[str, str], n_ctx: int
) -> tuple[float, float]:
    """(first, second) Enter-to-first-token of two turns in the app just after it opened the
    saved conversation ``name``: the first right after the restore on open, the second warm."""
    app = LocalChatApp(
        model_path,
        LaunchOptions(n_ctx=n_ctx),
        max_tokens=8,
        sampling=Sampling(temperature=0.0),
        conversation_name=name,
    )
    watch = _AppEvents()
    done, finished = watch.done, watch.finished
    async with app.run_test(size=(120, 36), message_hook=watch.hook) as pilot:
        await _wait(watch.restored, "the conversation restored")
        # The restore alone is measured: nothing is read ahead of Enter (typeahead_* is that).
        app.settings = replace(app.settings, type_ahead=False)
        for text in messages:
            # Each turn starts on a settled screen, the first as the second: Enter pressed the
            # moment the restore ended met the transcript still being laid out (the first
            # turn's event loop took 0.064-0.081 s of CPU against the second's 0.056-0.059,
            # taken from the model's two cores), where a person is still typing.
            await pilot.pause(SETTLE_S)
            done.clear()
            app.query_one("#input").text = text  # type: ignore[attr-defined]
            _press_enter(app)
            await _wait(done, "the reply")
    first, second = (f.turn.resume_ttft_s for f in finished[:2])
    return first, second


def app_resume_vs_warm(
    model_path: Path, home: Path, name: str, messages: tuple[str, str], n_ctx: int, rounds: int
) -> dict[str, Any]:
    """The first turn after the app opens a long conversation vs a warm turn: the median of
    each round's ratio (the two turns of a round are seconds apart; rounds are not, and the
    host's speed drifts between them); ``home`` holds the conversation and its saved state
    (copied for every round, so each round opens the same one)."""
    firsts, seconds = [], []
    for _ in range(rounds):
        with _scratch_home(copy_of=home):
            first, second = asyncio.run(_first_turns_after_open(model_path, name, messages, n_ctx))
        firsts.append(first)
        seconds.append(second)
    ratio = statistics.median(f / s for f, s in zip(firsts, seconds, strict=True))
    return {
        "app_first_turn_ttft_s": round(statistics.median(firsts), 4),
        "app_warm_turn_ttft_s": round(statistics.median(seconds), 4),
        "app_resume_vs_warm": round(ratio, 3),
    }


# Typing speed for the type-ahead figure: 20 characters a second (a quick typist).
TYPING_CHARS_PER_S = 20.0


async def _type_at_speed(pilot: Any, text: str, chars_per_s: float) -> None:
    """Type ``text`` key by key on a fixed schedule, as a person types: each key arrives at
    its time whatever the app is doing (``pilot.press`` would wait until the app is idle
    after each key, and a slow frame would slow the typist down)."""
    began = time.perf_counter()
    for index, char in enumerate(text):
        pilot.app.post_message(events.Key("space" if char == " " else char, char))
        delay = began + (index + 1) / chars_per_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await pilot.pause()  # the last keys are in before Enter


async def _type_ahead_turns(
    model_path: Path, long_messages: list[str], n_ctx: int
) -> dict[str, list[float]]:
    """Enter-to-first-token in one app session, per kind of turn: a one-word message, a long
    message typed at ``TYPING_CHARS_PER_S`` (read ahead while typed), and the same long
    message with reading ahead off (typed or pasted is then the same: it is put in at once)."""
    app = LocalChatApp(
        model_path, LaunchOptions(n_ctx=n_ctx), max_tokens=8, sampling=Sampling(temperature=0.0)
    )
    watch = _AppEvents()
    done, finished = watch.done, watch.finished
    times: dict[str, list[float]] = {"one_word": [], "typed": [], "cold": [], "read_ahead": []}

    async def turn(kind: str, text: str) -> None:
        done.clear()
        app.settings = replace(app.settings, type_ahead=kind != "cold")
        box = app.query_one("#input")
        if kind == "typed":
            await _type_at_speed(pilot, text, TYPING_CHARS_PER_S)
        else:
            box.text = text  # type: ignore[attr-defined]
        assert box.text == text  # type: ignore[attr-defined]
        _press_enter(app)
        await _wait(done, "the reply")
        stats = finished[-1].turn.stats_dict()
        times[kind].append(finished[-1].turn.sent_ttft_s)
        if kind == "typed":
            times["read_ahead"].append(stats["read_ahead_tokens"])
        await pilot.pause(SETTLE_S)

    async with app.run_test(size=(120, 36), message_hook=watch.hook) as pilot:
        await _wait(watch.loaded, "the model to load")
        await pilot.pause(SETTLE_S)
        await turn("one_word", "Hello.")  # the conversation is warm from here on
        for long_message in long_messages:
            await turn("one_word", "Thanks.")
            await turn("typed", long_message)
            await turn("cold", long_message)
        await turn("one_word", "Bye.")
    return times


def app_type_ahead(model_path: Path, long_messages: list[str], n_ctx: int) -> dict[str, Any]:
    """A long message typed in the app (read ahead as it is typed) against a one-word
    message: Enter-to-first-token, medians; and the long message with reading ahead off."""
    with _scratch_home():
        times = asyncio.run(_type_ahead_turns(model_path, long_messages, n_ctx))
    one_word = statistics.median(times["one_word"][1:])  # the first turn warms up
    typed, cold = statistics.median(times["typed"]), statistics.median(times["cold"])
    return {
        "typeahead_ttft_s": round(typed, 4),
        "typed_cold_ttft_s": round(cold, 4),
        "one_word_ttft_s": round(one_word, 4),
        "typeahead_vs_one_word": round(typed / one_word, 3),
        "typeahead_read_ahead_tokens": int(statistics.median(times["read_ahead"])),
    }


def measure_turn(side: str, model_path: Path, max_tokens: int) -> dict[str, Any]:
    """One side of the comparison, in this process: ``headless`` or ``app``."""
    with _scratch_home():
        if side == "headless":
            cpu, rate, tokens = _headless_cpu(model_path, max_tokens)
        else:
            cpu, rate, tokens = asyncio.run(_app_cpu(model_path, max_tokens))
    return {"cpu_s": cpu.total, "other_cpu_s": cpu.other, "gen_tps": rate, "tokens": tokens}


def _turn_in_fresh_process(side: str, model_path: Path, max_tokens: int) -> dict[str, Any]:
    """Each side runs in a new process, as a user's app does: nothing left over from other
    measurements (llama.cpp thread pools, Textual caches, garbage) weighs on it."""
    with tempfile.TemporaryDirectory(prefix="localchat-bench-ui-") as tmp:
        report = Path(tmp) / "turn.json"
        command = [sys.executable, "-m", "localchat.bench.app.measure", "turn", side]
        command += [str(model_path), str(max_tokens), str(report)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if not report.exists():
            raise RuntimeError(f"the {side} turn failed: {result.stderr.strip()[-500:]}")
        data: dict[str, Any] = json.loads(report.read_text())
        return data


@dataclass(frozen=True)
class Overhead:
    """Medians over pairs of turns: the app's extra CPU (its own threads; and the whole
    process's), the headless tokens/s, and the app's tokens/s over the headless run's."""

    overhead: float
    process_overhead: float
    gen_tps: float
    tokens: int
    tps_ratio: float


def _overhead(model_path: Path, max_tokens: int, rounds: int) -> Overhead:
    """``Overhead`` over ``rounds`` pairs, the order alternating so that drift in the
    machine's speed does not favour one side."""
    overheads, process, rates, ratios = [], [], [], []
    tokens = 0
    for round_index in range(rounds):
        sides = ("headless", "app") if round_index % 2 == 0 else ("app", "headless")
        runs = {side: _turn_in_fresh_process(side, model_path, max_tokens) for side in sides}
        headless, app = runs["headless"], runs["app"]
        tokens = headless["tokens"]
        if app["tokens"] != tokens:
            raise RuntimeError(
                f"the app's reply had {app['tokens']} tokens, headless {tokens}: not comparable"
            )
        overheads.append((app["other_cpu_s"] - headless["other_cpu_s"]) / headless["cpu_s"])
        process.append((app["cpu_s"] - headless["cpu_s"]) / headless["cpu_s"])
        rates.append(headless["gen_tps"])
        ratios.append(app["gen_tps"] / headless["gen_tps"])
    median = statistics.median
    return Overhead(median(overheads), median(process), median(rates), tokens, median(ratios))


def bench_ui(tiny_model: Path, main_model: Path | None = None) -> dict[str, Any]:
    """Startup and overhead on the tiny model (thousands of tokens/s: the UI's worst case),
    and the overhead on ``main_model`` at its real speed, for scale."""
    startup = [_startup_once(tiny_model) for _ in range(STARTUP_ROUNDS)]
    tiny = _overhead(tiny_model, UI_TOKENS, UI_ROUNDS)
    results: dict[str, Any] = {
        "ui_model": str(tiny_model),
        "ui_tokens": tiny.tokens,
        "ui_gen_tps": round(tiny.gen_tps, 1),
        "ui_cpu_overhead": round(tiny.overhead, 4),
        "ui_process_cpu_overhead": round(tiny.process_overhead, 4),
        "startup_s": round(steady_least(startup), 3),
    }
    if main_model is not None:
        main = _overhead(main_model, MAIN_MODEL_TOKENS, MAIN_MODEL_ROUNDS)
        results.update(
            {
                "ui_main_model": str(main_model),
                "ui_main_tokens": main.tokens,
                "ui_main_gen_tps": round(main.gen_tps, 1),
                "ui_cpu_overhead_main_model": round(main.overhead, 4),
                "ui_process_cpu_overhead_main_model": round(main.process_overhead, 4),
                "ui_main_tps_ratio": round(main.tps_ratio, 4),
            }
        )
    return results


if __name__ == "__main__":  # the fresh processes that the measurements run in
    if len(sys.argv) == 6 and sys.argv[1] == "turn":
        side, model, tokens, report = sys.argv[2:]
        figures = measure_turn(side, Path(model), int(tokens))
        Path(report).write_text(json.dumps(figures))
