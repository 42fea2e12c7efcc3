"""Several sequences decoded together in one llama.cpp context on an engine's loaded model:
what a server needs to answer requests side by side (continuous batching).

llama-cpp-python's ``Llama`` keeps one sequence, so this is llama.cpp's own API: a second
context on the same weights with ``n_seq_max`` sequences, each with a KV cache of its own
(``kv_unified`` off: measured here, a greedy reply among others is then the one it is
alone, with or without flash attention; a unified cache without flash attention changes
replies), one ``llama_decode`` per step for every sequence's tokens, a sampler chain per
sequence, and per-sequence cuts and saved states (the same bytes a conversation's state
file holds, so a server's prompt cache and a chat's are one format).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from localchat.backends.base import Sampling
from localchat.backends.llama.cache import state_pointer
from localchat.backends.llama.image_positions import image_start_before
from localchat.backends.llama.runtime import (
    DecodeStop,
    abort_requested,
    forget_log_since,
    last_error_line,
    log_position,
    watch_abort,
)
from localchat.backends.llama.sampler import SequenceSampler
from localchat.errors import ModelLoadError

if TYPE_CHECKING:
    from localchat.backends.llama.engine import Engine
    from localchat.backends.llama.image_reader import ImageReader


class StepInterrupted(Exception):
    """A step stopped midway by ``SequenceBatch.interrupt``: nothing of it was kept."""


@dataclass(frozen=True)
class Chunk:
    """Tokens one sequence adds in a step; ``logits``: whether its last token is sampled,
    ``every``: whether each of its tokens is (a drafted run, verified)."""

    seq: int
    tokens: Sequence[int]
    logits: bool = True
    every: bool = False


class BatchFull(RuntimeError):
    """llama.cpp found no room in the KV cache for a step (a sequence past its context)."""


class SequenceBatch:
    """``n_seq`` sequences of ``n_ctx_seq`` positions each, sharing the engine's weights.

    ``tokens[seq]`` is what each sequence's cache holds, position by position; ``decode``
    appends to it, ``cut`` and ``load`` change it. Runs on the compute thread, as the engine.
    """

    def __init__(self, engine: Engine, n_seq: int, n_ctx_seq: int) -> None:
        options = engine.options
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = n_seq
        params.n_ctx = n_ctx_seq * n_seq
        # A step carries a full prompt chunk and a token for every other sequence.
        self.capacity = min(options.n_batch, n_ctx_seq) + n_seq
        params.n_batch = self.capacity
        params.n_ubatch = options.n_ubatch
        params.n_threads = params.n_threads_batch = engine.threads
        params.type_k = params.type_v = engine.kv_type_id
        params.flash_attn_type = 1 if engine.flash_attn else 0
        params.kv_unified = False
        params.swa_full = options.swa_cache == "full"
        self.n_seq = n_seq
        self.n_ctx_seq = n_ctx_seq
        self.engine = engine
        self._context = llama_cpp.llama_init_from_model(engine.llm.model, params)
        if not self._context:
            raise ModelLoadError(
                f"{engine.model_path}: llama.cpp could not make a context for {n_seq} sequences"
                f" of {n_ctx_seq} tokens: {last_error_line()}; try a smaller --parallel or --ctx"
            )
        self._stop = DecodeStop()
        watch_abort(self._context, self._stop)
        self._memory = llama_cpp.llama_get_memory(self._context)
        self._step_batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        self._n_vocab = engine.n_vocab
        self.tokens: list[list[int]] = [[] for _ in range(n_seq)]
        # Per sequence, an index counted to and what M-RoPE images before it put positions
        # behind (``position``): a step counts the new cells only.
        self._behind: list[tuple[int, int]] = [(0, 0)] * n_seq

    # -- a step ------------------------------------------------------------------------------
    def decode(self, chunks: Sequence[Chunk]) -> dict[int, list[int]]:
        """Evaluate every chunk in one ``llama_decode``: {seq: the batch rows whose logits
        are sampled, in order}. ``BatchFull`` where a sequence has no room left."""
        batch = self._step_batch
        rows: dict[int, list[int]] = {}
        total = sum(len(chunk.tokens) for chunk in chunks)
        if total > self.capacity:  # checked before llama.cpp's arrays are written
            raise ValueError(f"a step of {total} tokens is over the batch's {self.capacity}")
        n = 0
        for chunk in chunks:
            start = self.position(chunk.seq, len(self.tokens[chunk.seq]))
            for offset, token in enumerate(chunk.tokens):
                batch.token[n] = token
                batch.pos[n] = start + offset
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = chunk.seq
                batch.logits[n] = chunk.every
                n += 1
            if chunk.every:
                rows[chunk.seq] = list(range(n - len(chunk.tokens), n))
            elif chunk.logits and chunk.tokens:
                batch.logits[n - 1] = True
                rows[chunk.seq] = [n - 1]
        batch.n_tokens = n
        logged = log_position()
        status = llama_cpp.llama_decode(self._context, batch)
        if status != 0:
            if abort_requested():
                raise KeyboardInterrupt
            # None of a failed step's tokens stay: llama.cpp drops the micro-batch that
            # failed, not those before it (a step splits where sequences add unequal runs).
            for chunk in chunks:
                self.cut(chunk.seq, len(self.tokens[chunk.seq]))
            if status == 2 and self._stop.is_set:
                forget_log_since(logged)  # not a failure
                raise StepInterrupted("the step was stopped midway (``interrupt``)")
            if status == 1:
                raise BatchFull("no room in the KV cache for this step")
            raise RuntimeError(f"llama.cpp could not decode a step: {last_error_line()}")
        for chunk in chunks:
            self.tokens[chunk.seq].extend(chunk.tokens)
        return rows

    def position(self, seq: int, index: int) -> int:
        """The position of the cell at ``index`` of ``seq``: its index, less what M-RoPE
        images before it take fewer positions than cells (``positions_behind``); a cell
        inside an image is at the image's start. Counted on from the last index asked (a
        step asks at the sequence's end, which only grows until a cut)."""
        reader = self.engine.image_reader
        if reader is None or not reader.mrope or index == 0:
            return index
        tokens = self.tokens[seq]
        index = image_start_before(tokens, index)
        held, behind = self._behind[seq]
        if index < held:
            held, behind = 0, 0
        behind += reader.positions_behind(tokens[held:index])
        self._behind[seq] = (index, behind)
        return index - behind

    def _set_tokens(self, seq: int, tokens: list[int]) -> None:
        """``seq`` holds ``tokens`` now: what was counted of its positions is forgotten."""
        self.tokens[seq] = tokens
        self._behind[seq] = (0, 0)

    def decode_image(self, seq: int, run: Sequence[int], reader: ImageReader) -> None:
        """Decode the image whose placeholder run is ``run`` into ``seq`` after what it
        holds: whole, by itself (libmtmd's helper decodes its embeddings in batches of
        its own, non-causal ones in one ubatch), never beside other sequences' tokens. An
        image that fails leaves nothing of it in the cache."""
        n_past = len(self.tokens[seq])
        n_batch = min(self.engine.options.n_batch, self.capacity)
        try:
            reader.evaluate(run, self.position(seq, n_past), n_batch, seq, self._context)
        except BaseException:
            self.cut(seq, n_past)
            if abort_requested():
                raise KeyboardInterrupt from None
            raise
        self.tokens[seq].extend(run)

    def clear_interrupt(self) -> None:
        """Drop an ``interrupt`` that came too late for the decode it was meant for: the
        caller clears it before and after each decode that may be interrupted."""
        self._stop.clear()

    def interrupt(self) -> None:
        """Stop the decode in flight between two graph nodes: it raises ``StepInterrupted``
        with the sequences' caches as they were before it (any thread)."""
        self._stop.set()

    def sampler(
        self,
        sampling: Sampling,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        grammar: str | None = None,
        logit_bias: Sequence[tuple[int, float]] = (),
    ) -> SequenceSampler:
        """A sampler for one sequence (``grammar``: GBNF its tokens must follow;
        ``logit_bias``: what to add to some tokens' logits)."""
        vocab = llama_cpp.llama_model_get_vocab(self.engine.llm.model)
        return SequenceSampler(
            sampling,
            self._n_vocab,
            frequency_penalty,
            presence_penalty,
            None if grammar is None else (vocab, grammar),
            logit_bias,
        )

    def sample(self, sampler: SequenceSampler, row: int) -> int:
        """The next token from ``row``'s logits (the sampler remembers it for penalties)."""
        return sampler.sample(self._context, row)

    def logprobs(self, row: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """``token``'s log probability in ``row``'s distribution (the model's own, before
        any sampler), and the ``top`` most likely tokens' (OpenAI's ``logprobs``)."""
        pointer = llama_cpp.llama_get_logits_ith(self._context, row)
        logits = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,)).astype(np.float64)
        peak = logits.max()
        total = peak + np.log(np.exp(logits - peak).sum())
        best: list[tuple[int, float]] = []
        if top > 0:
            ids = np.argpartition(-logits, min(top, self._n_vocab - 1))[:top]
            ids = ids[np.argsort(-logits[ids], kind="stable")]
            best = [(int(i), float(logits[i] - total)) for i in ids]
        return float(logits[token] - total), best

    # -- a sequence's cache --------------------------------------------------------------------
    def cut(self, seq: int, keep: int) -> bool:
        """Keep the first ``keep`` positions of ``seq``; False where that cannot continue
        exactly (a window cache that dropped positions the next token would look at, as
        ``KVCache.keeps`` says for one sequence): then the sequence is emptied."""
        held = len(self.tokens[seq])
        window = self.engine.n_swa if self.engine.windowed else 0
        if keep < held and window:
            pos_min = int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq))
            if pos_min > max(0, self.position(seq, keep) - window):
                keep = -1
        if keep >= 0 and llama_cpp.llama_memory_seq_rm(
            self._memory, seq, self.position(seq, keep), -1
        ):
            del self.tokens[seq][keep:]
            return True
        llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)
        self._set_tokens(seq, [])
        return keep == 0

    def copy(self, source: int, target: int, keep: int) -> bool:
        """Make ``target`` hold the first ``keep`` positions of ``source`` (a prefix two
        requests share: copied, not evaluated again). Each sequence has a cache of its own,
        so llama.cpp copies the whole cache, at the next decode, and the rest is cut."""
        llama_cpp.llama_memory_seq_cp(self._memory, source, target, -1, -1)
        self._set_tokens(target, list(self.tokens[source]))
        return self.cut(target, keep)

    def save(self, seq: int) -> bytes:
        """The raw KV state of ``seq``: the bytes a state file stores."""
        size = llama_cpp.llama_state_seq_get_size(self._context, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._context, buffer, size, seq)
        return bytes(memoryview(buffer)[:written])

    def load(self, seq: int, data: bytes | memoryview, tokens: Sequence[int]) -> bool:
        """Restore a saved state holding ``tokens`` into ``seq``; False if llama.cpp refuses."""
        self.cut(seq, 0)
        if len(tokens) > self.n_ctx_seq:
            return False
        read = llama_cpp.llama_state_seq_set_data(
            self._context, state_pointer(data), len(data), seq
        )
        if read != len(data):
            self.cut(seq, 0)
            return False
        self._set_tokens(seq, list(tokens))
        return True

    @property
    def cells_used(self) -> int:
        return sum(len(t) for t in self.tokens)

    def close(self) -> None:
        if self._step_batch is not None:
            with contextlib.suppress(Exception):
                llama_cpp.llama_batch_free(self._step_batch)
            self._step_batch = None
        if self._context:
            llama_cpp.llama_free(self._context)
            self._context = None
