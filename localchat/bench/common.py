"""What several bench parts share: progress lines, scratch homes, greedy turns, filler text
and the 2,000-token conversation (one definition, so every part measures the same thing)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.models.calibrate import confirmed
from localchat.paths import HOME_ENV

if TYPE_CHECKING:
    from localchat.backends.base import TurnStats
    from localchat.backends.llama.engine import Engine
    from localchat.conversation.local import Conversation

Progress = Callable[[str], None] | None
"""Where a part reports what it is doing (None: quietly, as with ``--json``)."""

# The long conversation that resume, zerowait and branch continue: a context with room for
# it, user messages of ~120 tokens and short greedy replies, to 2,000 tokens.
HISTORY_CTX = 4096
HISTORY_TOKENS = 2000
HISTORY_TURN_WORDS = 120
REPLY_TOKENS = 8


def settled(values: list[float], agree: float, last: int = 2) -> bool:
    """Whether the last ``last`` measurements agree within ``agree`` (relative to the
    largest): more rounds would not move their median by more than the machine's noise, so a
    part sized by noise can stop there."""
    if len(values) < last:
        return False
    tail = values[-last:]
    return max(tail) - min(tail) <= agree * max(tail)


# How close another round must come to a side's best for that best to count (``steady_*``).
STEADY = 0.05


def steady_least(values: list[float], tolerance: float = STEADY) -> float:
    """The least of one side's times over its rounds that another round confirms within
    ``tolerance`` (the calibration's rule, ``models.calibrate.confirmed``); the median where
    no two agree. For a figure of one side (startup, a model's speed against its
    prediction): a shared host's neighbours mostly add to a round, so the best that repeats
    is what it costs on a quiet machine, and a lone best (a moment of boost) does not count.
    Two sides measured in adjacent pairs are compared by the median of the pairs' ratios
    instead: drift cancels within a pair."""
    found = confirmed(values, tolerance)
    return found if found is not None else statistics.median(values)


def steady_best(speeds: list[float], tolerance: float = STEADY) -> float:
    """``steady_least`` for speeds (tokens/s): the fastest round another confirms."""
    return 1.0 / steady_least([1.0 / speed for speed in speeds], tolerance)


def say(progress: Progress, line: str) -> None:
    """One progress line, if anyone listens."""
    if progress is not None:
        progress(line)


@contextlib.contextmanager
def scratch_dir(label: str = "") -> Iterator[Path]:
    """A temporary folder for one measurement's store and states: the user's data is never
    read or written by the bench."""
    with tempfile.TemporaryDirectory(prefix=f"localchat-bench-{label}") as tmp:
        yield Path(tmp)


def env_with_home(home: Path) -> dict[str, str]:
    """This process's environment with ``home`` as LOCALCHAT_HOME: what a child process of a
    measurement runs with, so it sees only the scratch conversations."""
    return {**os.environ, HOME_ENV: str(home)}


def ask_in_new_process(
    home: Path, model_path: Path, message: str, n_ctx: int, *extra: str
) -> dict[str, Any]:
    """One greedy turn of the conversation ``bench`` through the real CLI in a fresh process
    with ``home`` as its LOCALCHAT_HOME; ``ask --json``'s payload (model load is not timed
    in ttft)."""
    command = [
        sys.executable, "-m", "localchat.cli.main", "ask", message,
        "--model-path", str(model_path), "--conversation", "bench", "--ctx", str(n_ctx),
        "--temperature", "0", "--max-tokens", str(REPLY_TOKENS), "--json", *extra,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=env_with_home(home), check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"bench turn failed: {result.stderr.strip()}")
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


@dataclass
class ChildHome:
    """A new process's data: a copy of the saved conversation, made afresh before each run."""

    backup: Path
    path: Path

    def reset(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.copytree(self.backup, self.path / "data")


def greedy_turn(engine: Engine, prompt: list[int], max_tokens: int, cold: bool = True) -> TurnStats:
    """One greedy generation run to its end; its stats. ``cold``: from an empty cache (the
    same starting point every round, so rounds compare); else after ``prompt``, cached by
    the last turn (its reply cut off): the same fill and positions, the prompt not read again."""
    from localchat.backends.base import Sampling

    if cold:
        engine.cache.reset()
    generation = engine.generate(prompt, Sampling(temperature=0.0), max_tokens)
    for _ in generation:
        pass
    return generation.stats


def filler_text(turn: int, words: int) -> str:
    """Deterministic prose-like text of about ``words`` tokens for long user messages."""
    vocabulary = (
        "the model keeps a cache of every token it has read so that the next reply starts "
        "at once instead of reading the whole conversation again from the first word"
    ).split()
    return " ".join(vocabulary[(turn * 7 + i) % len(vocabulary)] for i in range(words))


def build_history(
    conversation: Conversation, progress: Progress = None, label: str = "resume"
) -> None:
    """Chat-like turns (user messages of ~120 tokens, short greedy replies) until the cache
    holds HISTORY_TOKENS: the long conversation the resume and zero-wait figures use."""
    from localchat.backends.base import Sampling

    turn_no = 0
    while len(conversation.backend.cache.cached_tokens) < HISTORY_TOKENS:
        text = filler_text(turn_no, HISTORY_TURN_WORDS)
        for _ in conversation.send(text, Sampling(temperature=0.0), REPLY_TOKENS):
            pass
        turn_no += 1
        say(progress, f"{label}: history at {len(conversation.backend.cache.cached_tokens)} tokens")
