"""Shared prefix states: a long system prompt evaluated once is restored, not re-read.

A new conversation (or a one-off ``ask``) whose prompt starts with a system prompt of at
least ``min_tokens`` evaluates that prefix on its own, in the batches a cold start uses, and
saves its KV state keyed by the exact token ids (and, like every state, by the model file,
context size, KV type and llama.cpp build). The next start with the same prefix restores it
and evaluates only the rest. Because the prefix always ends its own batch, the restored
cache is bit for bit the one a cold start builds, and the greedy continuation is the same.
States live in the conversations' states folder, share its disk budget (least recently
used go first) and are validated the same way; the same prefix is one file. Files attached
at the start of a new conversation's first message are a second prefix, after the system
prompt's: the same files opening another conversation are restored, not read again.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localchat.backends.llama.cache import KVCache, ReplayStopped
from localchat.backends.llama.image_positions import batch_starts
from localchat.chat.attachments import attachments_end
from localchat.chat.prompt import BuiltPrompt, PromptBuilder
from localchat.chat.template import ChatMessage
from localchat.state.kvstate import (
    BackgroundSaver,
    SavedState,
    StateKey,
    StateRejected,
    StateStore,
    tokens_state_id,
)

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
    return tokens_state_id(ID_PREFIX, tokens)


def system_span(prompt: BuiltPrompt, n_system: int) -> int:
    """Where the prompt's system messages end (0 without one)."""
    return prompt.spans[n_system - 1][1] if n_system and len(prompt.spans) >= n_system else 0


def prefix_spans(
    builder: PromptBuilder, messages: Sequence[ChatMessage], prompt: BuiltPrompt, n_system: int
) -> list[int]:
    """Where a cold start's shared prefixes end in ``prompt``: after the system prompt, and,
    when the first message opens with attached files, after those files (their tokens are
    the same whatever question follows them)."""
    spans = [system_span(prompt, n_system)]
    if len(messages) == n_system + 1 and messages[-1].role == "user":
        end = attachments_end(messages[-1].content)
        if end:
            spans.append(builder.build_draft(messages, (), cut=end)[1])
    return spans


def _batch_starts(prompt: Sequence[int], spans: Sequence[int], n_batch: int) -> list[int]:
    """How a cold start evaluates up to the last of ``spans``: each prefix ends its own
    batches, so every prefix state is bit for bit what a cold start builds (an image is a
    batch of its own, whole)."""
    starts: list[int] = []
    begin = 0
    for span in spans:
        starts.extend(batch_starts(prompt, begin, span, n_batch))
        begin = span
    return starts


def start_from_prefix(
    cache: KVCache,
    states: StateStore,
    key: StateKey,
    prompt: Sequence[int],
    spans: Sequence[int],
    min_tokens: int,
    saver: BackgroundSaver | None = None,
    stop: Callable[[], bool] | None = None,
) -> PrefixStart | None:
    """For a cache that holds nothing: restore the longest saved prefix of ``prompt`` that
    ends at one of ``spans``, then evaluate up to the last span, saving each prefix on the
    way. None when there is nothing to do (no span of ``min_tokens`` or more, the setting
    off, a cache already in use, a prefix as long as the prompt). ``stop`` is asked between
    batches: ``ReplayStopped`` if it says to give way (nothing is kept)."""
    ends = sorted({s for s in spans if min_tokens <= s < len(prompt)})
    if min_tokens <= 0 or not ends or cache.cached_tokens:
        return None
    began = time.perf_counter()
    restored = 0
    for span in reversed(ends):
        prefix = list(prompt[:span])
        try:
            saved = states.load(prefix_id(prefix), key)
        except StateRejected:
            continue
        starts = _batch_starts(prompt, [e for e in ends if e <= span], cache.n_batch)
        if list(saved.tokens) == prefix and cache.load_sequence_state(
            saved.payload, prefix, starts
        ):
            restored = span
            break
        states.discard(prefix_id(prefix), key.model_fingerprint)  # refused: rebuilt below
    done = restored
    try:
        for span in ends:
            if span <= done:
                continue
            bounds = [*batch_starts(prompt, done, span, cache.n_batch), span]
            for start, stop_at in itertools.pairwise(bounds):
                if stop is not None and start > 0 and stop():
                    raise ReplayStopped
                cache.extend(prompt[start:stop_at])
            cache.commit(span)
            done = span
            state = SavedState(key, list(prompt[:span]), cache.save_sequence_state())
            if saver is not None:
                saver.save(prefix_id(state.tokens), state)  # in the background, like a chat's
            else:
                states.save(prefix_id(state.tokens), state)
    except ReplayStopped:
        cache.reset()
        raise
    return PrefixStart(
        restored=restored, evaluated=done - restored, seconds=time.perf_counter() - began
    )
