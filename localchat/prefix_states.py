"""Shared prefix states: a long system prompt evaluated once is restored, not re-read.

A new conversation (or a one-off ``ask``) whose prompt starts with a system prompt of at
least ``min_tokens`` evaluates that prefix on its own, in the batches a cold start uses, and
saves its KV state keyed by the exact token ids (and, like every state, by the model file,
context size, KV type and llama.cpp build). The next start with the same prefix restores it
and evaluates only the rest. Because the prefix always ends its own batch, the restored
cache is bit for bit the one a cold start builds, and the greedy continuation is the same.
States live in the conversations' states folder, share its disk budget (least recently
used go first) and are validated the same way; the same prefix is one file.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localchat.engine import Engine
from localchat.kvstate import BackgroundSaver, SavedState, StateKey, StateRejected, StateStore
from localchat.prompt import BuiltPrompt

ID_PREFIX = "prefix-"
DEFAULT_MIN_TOKENS = 256


@dataclass(frozen=True)
class PrefixStart:
    """How a cold start began: ``restored`` tokens from a saved prefix, or ``evaluated`` ones
    (the prefix, read on its own and saved) in ``seconds``."""

    restored: int = 0
    evaluated: int = 0
    seconds: float = 0.0


def prefix_id(tokens: Sequence[int]) -> str:
    """The state's name: a hash of the exact token ids (the file holds them to compare)."""
    digest = hashlib.sha256(array("i", tokens).tobytes()).hexdigest()
    return f"{ID_PREFIX}{digest[:32]}"


def system_span(prompt: BuiltPrompt, n_system: int) -> int:
    """Where the prompt's system messages end (0 without one)."""
    return prompt.spans[n_system - 1][1] if n_system and len(prompt.spans) >= n_system else 0


def start_from_prefix(
    engine: Engine,
    states: StateStore,
    key: StateKey,
    prompt: Sequence[int],
    span: int,
    min_tokens: int,
    saver: BackgroundSaver | None = None,
    stop: Callable[[], bool] | None = None,
) -> PrefixStart | None:
    """For a cache that holds nothing: restore the saved state of ``prompt[:span]``, else
    evaluate that prefix alone and save it. None when there is nothing to do (a short or no
    system prompt, the setting off, a cache already in use, a prefix as long as the prompt).
    ``stop`` is asked between two batches of the evaluation: ``ReplayStopped`` if it says to
    give way (nothing is kept)."""
    if min_tokens <= 0 or span < min_tokens or span >= len(prompt) or engine.cached_tokens:
        return None
    prefix = list(prompt[:span])
    name = prefix_id(prefix)
    starts = list(range(0, span, engine.n_batch))
    began = time.perf_counter()
    try:
        saved = states.load(name, key)
    except StateRejected:
        saved = None
    if saved is not None and list(saved.tokens) == prefix:
        if engine.load_sequence_state(saved.payload, prefix, starts):
            return PrefixStart(restored=span, seconds=time.perf_counter() - began)
        states.discard(name, key.model_fingerprint)  # llama.cpp refused it: rebuilt below
    if not engine.replay(prefix, starts, stop):
        return None
    state = SavedState(key, prefix, engine.save_sequence_state())
    if saver is not None:
        saver.save(name, state)  # written in the background, like a conversation's
    else:
        states.save(name, state)
    return PrefixStart(evaluated=span, seconds=time.perf_counter() - began)
