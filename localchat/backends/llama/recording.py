"""llama-cpp-python's ``Llama``, recording how its cache was evaluated (batch starts, tokens
computed) and stopping between graph nodes when an abort is requested."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import llama_cpp

from localchat.backends.llama.image_positions import (
    ImageDecoder,
    has_images,
    image_start_before,
    pieces,
    starts_image,
)
from localchat.backends.llama.internals import (
    decode_filled_batch,
    drop_cells_from,
    eval_behind,
    fill_batch_every_position,
    set_logits_stale,
)
from localchat.backends.llama.runtime import abort_requested


class RecordingLlama(llama_cpp.Llama):
    """Llama that records what it evaluates: how many tokens (reused vs computed), and where
    each batch started.

    llama.cpp's numerics depend on how tokens are batched (a token evaluated alone and the
    same token inside a batch of 500 can differ in the last bits), so a history re-evaluated
    in other batches can continue differently. Replaying the recorded batches rebuilds the
    cache bit for bit. ``batch_starts`` is None when the history is not fully known.

    While an abort is requested (``runtime.request_abort``: Ctrl+C in the CLI) it evaluates
    nothing: a decode stops between two graph nodes and the evaluation raises
    ``KeyboardInterrupt``, the cache holding the batches that were finished.
    """

    tokens_evaluated: int = 0
    batch_starts: list[int] | None = None
    # Speculative decoding (drafting.py): the next evaluation of this many tokens verifies a
    # draft, so it asks llama.cpp for every position's logits; ``batch_invariant`` says
    # whether the kernels give a batch the logits single steps would
    # (``Engine.batch_invariant``), so that the batch record stays exact with drafts in it.
    verify_next: int = 0
    batch_invariant: bool = False
    # The last evaluation's size and wall time: what drafting pays for a step of that size.
    last_eval: tuple[int, float] = (0, 0.0)
    # The projector that decodes images where a token list has their placeholder runs
    # (``image_positions``); None: the model reads no images.
    images: ImageDecoder | None = None

    def position(self, index: int) -> int:
        """The position of the cell at ``index``: its index, less what the images before
        it take fewer positions than cells (M-RoPE's; ``ImageDecoder.positions_behind``);
        a cell inside an image is at the image's start."""
        if self.images is None or index == 0:
            return index
        held = self.input_ids[: self.n_tokens]
        if index < self.n_tokens and held[index] < 0:
            index = image_start_before(held, index)
        return index - self.images.positions_behind(self.input_ids[:index])

    def eval(self, tokens: Sequence[int]) -> None:
        if has_images(tokens):
            self._eval_with_images(tokens)
            return
        if abort_requested():
            raise KeyboardInterrupt
        n_past = self.n_tokens
        behind = n_past - self.position(n_past)
        verify = self.verify_next == len(tokens) > 1
        self.verify_next = 0
        starts = self.batch_starts
        if starts is not None:  # sorted; in place, so a long reply costs O(1) per token
            if starts and starts[-1] >= n_past:
                del starts[bisect.bisect_left(starts, n_past) :]
            starts.extend(range(n_past, n_past + len(tokens), self.n_batch))
            if verify and not self.batch_invariant:
                # Drafts rejected later leave a batch of another size than a replay makes;
                # where that changes the numbers, the record no longer says how to rebuild.
                self.batch_starts = None
        self.tokens_evaluated += len(tokens)
        started = time.perf_counter()
        try:
            if verify:
                self._eval_every_position(tokens)
            elif behind:
                eval_behind(self, tokens, behind)
            else:
                super().eval(tokens)
        except RuntimeError:  # llama_decode returned an error code: 2 when it was aborted
            if not abort_requested():
                raise
            self._forget_unfinished(n_past + len(tokens))
            raise KeyboardInterrupt from None
        self.last_eval = (len(tokens), time.perf_counter() - started)

    def _eval_with_images(self, tokens: Sequence[int]) -> None:
        """Evaluate text and images in order: text as ``eval`` does, each image decoded by
        the projector (one recorded batch start for all of it: a replay decodes it whole
        again). A list that starts inside an image evaluates that image from its start."""
        tokens = [int(t) for t in tokens]
        if not starts_image(tokens[0]) and tokens[0] < 0:
            held = [int(t) for t in self.input_ids[: self.n_tokens]]
            start = image_start_before([*held, tokens[0]], self.n_tokens)
            tokens = held[start:] + tokens
            self.n_tokens = start
        for piece in pieces(tokens, self.n_tokens):
            if piece.image_id:
                self._eval_image(piece.tokens)
            else:
                self.eval(piece.tokens)

    def _eval_image(self, run: Sequence[int]) -> None:
        """Decode one image into the cells after ``n_tokens``; ``run`` is its placeholders."""
        if self.images is None:
            raise ValueError("this model has no projector: it cannot read images")
        if abort_requested():
            raise KeyboardInterrupt
        n_past = self.n_tokens
        position = self.position(n_past)
        drop_cells_from(self, position)
        starts = self.batch_starts
        if starts is not None:
            del starts[bisect.bisect_left(starts, n_past) :]
            starts.append(n_past)
        started = time.perf_counter()
        try:
            self.images.evaluate(run, position, self.n_batch)
        except Exception:  # nothing of the image stays
            drop_cells_from(self, position)
            if abort_requested():
                raise KeyboardInterrupt from None
            raise
        self.input_ids[n_past : n_past + len(run)] = run
        self.n_tokens += len(run)
        self.tokens_evaluated += len(run)
        set_logits_stale(self, True)  # an image asks for no logits: text after it does
        self.last_eval = (len(run), time.perf_counter() - started)

    def _eval_every_position(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` for one batch (a draft and the token before it) with the logits of
        every position: llama-cpp-python asks only for a batch's last unless ``logits_all``,
        which keeps n_ctx x n_vocab floats for the whole context. Sampling then reads each
        position's logits from llama.cpp (``llama_get_logits_ith``)."""
        n_past = self.n_tokens
        drop_cells_from(self, self.position(n_past))
        fill_batch_every_position(self, tokens, self.position(n_past))
        decode_filled_batch(self)
        self.input_ids[n_past : n_past + len(tokens)] = tokens
        self.n_tokens += len(tokens)
        set_logits_stale(self, False)

    def _forget_unfinished(self, end: int) -> None:
        """After an aborted evaluation: the cache and the records end where the last whole
        batch did (llama.cpp keeps an aborted batch's finished micro-batches)."""
        drop_cells_from(self, self.position(self.n_tokens))
        self.tokens_evaluated -= end - self.n_tokens
        starts = self.batch_starts
        if starts is not None:
            del starts[bisect.bisect_left(starts, self.n_tokens) :]
