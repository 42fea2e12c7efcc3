"""The engine's KV cache, a part the engine holds (``Engine.cache``): what it holds and for
whom, cutting it back (exactly, or by replaying the batches that built it), shifting a span
out in place, reading ahead, and its saved state. It works on llama-cpp-python's ``Llama``
and the batch record ``RecordingLlama`` keeps.

Whose tokens the cache holds is a lease, as a paged cache's manager keeps one per request:
a conversation ``claim``s the cache when it puts its tokens there (a restore, a replay, a
turn), and whatever put tokens there as that conversation's history ``commit``s them (a
generation its prompt and reply, a restore its state, a prefix its span). Past
``committed`` the cache holds tokens read ahead of a message still being typed: they count
for the next prompt only where they are its exact ids. A ``reset`` ends the lease."""

from __future__ import annotations

import bisect
import ctypes
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from localchat.backends.llama.image_positions import starts_image
from localchat.backends.llama.internals import drop_cells_from, logits_stale, set_logits_stale
from localchat.backends.llama.recording import RecordingLlama
from localchat.chat.prompt import common_prefix
from localchat.errors import ModelLoadError


def state_pointer(data: bytes | memoryview) -> Any:
    """A saved state's bytes as the pointer llama.cpp reads them from, without a copy, also
    of a read-only buffer (a state file's mapping, ``state.kvstate.read_state``): numpy takes
    any buffer's address, and the pointer keeps the buffer alive. A copy of a 2,000-token
    state of SmolLM2 is 45 MB of fresh memory: 30-34 ms here, more than the whole restore
    (mapping, checksum, llama.cpp's own copy) takes without it."""
    return np.frombuffer(data, dtype=np.uint8).ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class ReplayStopped(Exception):
    """A replay gave way between two batches (``KVCache.replay``'s ``stop``); the cache is
    empty."""


class KVCache:
    """The KV cache of one loaded context (sequence 0 of ``llm``), and whose tokens it holds.

    ``n_swa`` is the window of the model's sliding-window layers, in positions; ``windowed``
    says their cache keeps only that window, so it cannot be cut back far (``keeps``).
    """

    def __init__(self, llm: RecordingLlama, n_swa: int, windowed: bool) -> None:
        self._llm = llm
        self.n_swa = n_swa
        self.windowed = windowed
        self._owner: str | None = None
        self._committed = 0

    # -- the lease: whose tokens these are -------------------------------------------------
    def claim(self, owner: str) -> None:
        """The cache holds ``owner``'s tokens now (it restored, replayed or read them): its
        first ``committed`` tokens are that conversation's history, until a ``reset`` or
        another owner's claim."""
        self._owner = owner

    def held_by(self, owner: str) -> bool:
        """Whether the cache holds ``owner``'s tokens (its claim stands)."""
        return self._owner == owner

    @property
    def owner(self) -> str | None:
        """Who claimed the cache last (None: no one since it was reset)."""
        return self._owner

    def commit(self, n_tokens: int | None = None) -> None:
        """The first ``n_tokens`` cached (None: all of them) are the owner's history, put
        there by its turns, a restore or a replay: what the cache holds past them was read
        ahead, and goes where the next prompt differs."""
        self._committed = int(self._llm.n_tokens) if n_tokens is None else n_tokens

    @property
    def committed(self) -> int:
        """How many cached tokens are the owner's history (``commit``)."""
        return self._committed

    @property
    def committed_tokens(self) -> list[int]:
        """The owner's history as cached, without what was read ahead past it."""
        return self.cached_tokens[: self._committed]

    @property
    def n_ctx(self) -> int:
        """The context size asked for: how many tokens a prompt plus reply may hold."""
        return len(self._llm.input_ids)

    @property
    def n_batch(self) -> int:
        """Tokens one evaluation batch holds: a cold prompt is read in batches of this."""
        return int(self._llm.n_batch)

    @property
    def cached_tokens(self) -> list[int]:
        """Token ids whose keys and values are in the cache now, in position order."""
        return [int(t) for t in self._llm.input_ids[: self._llm.n_tokens]]

    def keeps(self, n_tokens: int) -> bool:
        """Whether the cache can be cut back to its first ``n_tokens`` and continue exactly.
        A window cache has dropped positions its sliding-window layers no longer look at;
        cut back past them, the next token would see too little (llama-server's rule)."""
        if not self.windowed or n_tokens >= self._llm.n_tokens:
            return True
        memory = llama_cpp.llama_get_memory(self._llm.ctx)
        pos_min = int(llama_cpp.llama_memory_seq_pos_min(memory, 0))
        return pos_min <= max(0, self._llm.position(n_tokens) - self.n_swa)

    def prepare_prefix(self, prompt: Sequence[int]) -> None:
        """Before a generation: where it would cut the cache back further than a window
        cache allows, rebuild that prefix instead (llama.cpp would not refuse the cut)."""
        cached = self._llm.n_tokens
        if not self.windowed or not cached:
            return
        held = self.cached_tokens
        shared = common_prefix(held, prompt)
        if shared == cached == len(prompt) and not logits_stale(self._llm):
            return  # the prompt is the cache: generation samples at once
        keep = shared - 1 if shared == len(prompt) else shared  # what llama-cpp-python keeps
        if keep < cached and not self.keeps(keep):
            self.cut_back(held[:keep])

    def cut_back(self, tokens: Sequence[int]) -> None:
        """Make the cache hold a prefix of ``tokens`` (itself a prefix of what it holds) where
        it cannot simply be cut: replayed up to the last batch boundary in the batches that
        first built it (the next evaluation then redoes the rest as the first one did, bit
        for bit), else forgotten. Never a cache that would continue wrongly."""
        starts = self._llm.batch_starts
        cut = len(tokens)
        if starts:
            boundary = max((s for s in starts if s <= cut), default=0)
            prefix = list(tokens[:boundary])
            if boundary > 0 and self.replay(prefix, [s for s in starts if s < boundary]):
                return
        self.reset()

    @property
    def batch_starts(self) -> list[int] | None:
        """Positions where each evaluation batch of the cached tokens began (None: unknown)."""
        starts = self._llm.batch_starts
        return None if starts is None else list(starts)

    def reset(self) -> None:
        """Forget the cache: the next generation evaluates its whole prompt."""
        self._llm.reset()
        drop_cells_from(self._llm, 0)
        self._llm.batch_starts = []
        self._owner = None
        self._committed = 0

    def can_shift(self) -> bool:
        """Whether llama.cpp can move cached positions for this model (RoPE re-rotation)."""
        memory = llama_cpp.llama_get_memory(self._llm.ctx)
        return memory is not None and bool(llama_cpp.llama_memory_can_shift(memory))

    def drop_span(self, start: int, count: int) -> None:
        """Remove cached tokens [start, start + count) and shift the later ones down in place.

        The shifted keys are re-rotated to their new positions; nothing is re-evaluated. The
        result is not what evaluating the shorter sequence would give (the kept tokens saw the
        dropped ones), so the cache's evaluation history becomes unknown.
        """
        n_tokens = self._llm.n_tokens
        if count <= 0 or start < 0 or start + count > n_tokens:
            raise ValueError(
                f"cannot drop [{start}, {start + count}) from {n_tokens} cached tokens"
            )
        memory = llama_cpp.llama_get_memory(self._llm.ctx)
        if not llama_cpp.llama_memory_seq_rm(memory, 0, start, start + count):
            raise ModelLoadError("llama.cpp could not remove tokens from the KV cache")
        llama_cpp.llama_memory_seq_add(memory, 0, start + count, -1, -count)
        ids = self._llm.input_ids
        ids[start : n_tokens - count] = ids[start + count : n_tokens].copy()
        self._llm.n_tokens = n_tokens - count
        self._llm.batch_starts = None
        self._committed = max(0, self._committed - count)

    def replay(
        self,
        tokens: Sequence[int],
        batch_starts: Sequence[int],
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Evaluate ``tokens`` in exactly the batches that first evaluated them.

        The cache comes out bit-identical to the one those batches built, so the continuation
        matches a process that never lost its cache. False (and nothing evaluated) if the
        batches do not describe ``tokens``; ``ReplayStopped`` (the cache empty) if ``stop``
        said to give way between two batches.
        """
        bounds = [*batch_starts, len(tokens)]
        valid = bool(batch_starts) and batch_starts[0] == 0
        valid = valid and all(
            0 < b - a <= self.n_batch or starts_image(tokens[a])  # an image is decoded whole
            for a, b in itertools.pairwise(bounds)
        )
        if not valid or len(tokens) >= self.n_ctx:
            return False
        self.reset()
        for a, b in itertools.pairwise(bounds):
            if stop is not None and a > 0 and stop():
                self.reset()
                raise ReplayStopped
            self._llm.eval(list(tokens[a:b]))
        self.commit(len(tokens))
        return True

    def extend(self, tokens: Sequence[int]) -> None:
        """Evaluate ``tokens`` after what the cache holds, as one batch (at most ``n_batch``):
        reading a message ahead adds a few tokens at a time (past ``committed``)."""
        text = sum(1 for t in tokens if t >= 0)  # an image's cells are decoded apart
        if text > self.n_batch or self._llm.n_tokens + len(tokens) >= self.n_ctx:
            raise ValueError(f"cannot add {len(tokens)} tokens to {self._llm.n_tokens} cached")
        if tokens:
            self._llm.eval(list(tokens))

    def hold(self, sequence: Sequence[int]) -> None:
        """Make the cache hold exactly ``sequence`` where it holds a prefix of it or it is a
        prefix of the cache: a reply's last generated token is never evaluated by generation,
        and tokens generated past a stop string are not part of the reply. The next prompt
        (and a saved state) then hold the reply as it stands."""
        cached = self._llm.n_tokens
        n = len(sequence)
        common = min(cached, n)
        if n >= self.n_ctx or [int(t) for t in self._llm.input_ids[:common]] != list(
            sequence[:common]
        ):
            return
        if cached < n:
            self._llm.eval(list(sequence[cached:]))
        elif n < cached and not self.keeps(n):
            self.cut_back(sequence)
        elif n < cached:
            memory = llama_cpp.llama_get_memory(self._llm.ctx)
            if llama_cpp.llama_memory_seq_rm(memory, 0, self._llm.position(n), -1):
                self._llm.n_tokens = n
                # llama.cpp's last logits belong to a later position now: a prompt equal to
                # the cache must evaluate its last token again, not sample from them.
                set_logits_stale(self._llm, True)
                self._committed = min(self._committed, n)
                starts = self._llm.batch_starts
                if starts is not None:
                    del starts[bisect.bisect_left(starts, n) :]

    def save_sequence_state(self) -> bytes:
        """The raw KV state of sequence 0 (no logits array): what a state file stores."""
        ctx = self._llm.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, 0)
        return bytes(memoryview(buffer)[:written])

    def load_sequence_state(
        self,
        data: bytes | memoryview,
        tokens: Sequence[int],
        batch_starts: Sequence[int] | None = None,
    ) -> bool:
        """Restore a saved KV state that holds ``tokens``; False if llama.cpp rejects it.

        ``batch_starts`` is how those tokens were evaluated, if known. ``data`` is handed to
        llama.cpp without a copy (``state_pointer``).
        """
        self.reset()
        read = llama_cpp.llama_state_seq_set_data(self._llm.ctx, state_pointer(data), len(data), 0)
        if read != len(data) or len(tokens) > self.n_ctx:
            self.reset()
            return False
        self._llm.input_ids[: len(tokens)] = list(tokens)
        self._llm.n_tokens = len(tokens)
        self.commit(len(tokens))
        set_logits_stale(self._llm, True)
        self._llm.batch_starts = None if batch_starts is None else list(batch_starts)
        return True
