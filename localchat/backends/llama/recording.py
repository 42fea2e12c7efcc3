"""llama-cpp-python's ``Llama``, recording how its cache was evaluated (batch starts, tokens
computed) and stopping between graph nodes when an abort is requested."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import llama_cpp

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

    def eval(self, tokens: Sequence[int]) -> None:
        if abort_requested():
            raise KeyboardInterrupt
        n_past = self.n_tokens
        starts = self.batch_starts
        if starts is not None:  # sorted; in place, so a long reply costs O(1) per token
            if starts and starts[-1] >= n_past:
                del starts[bisect.bisect_left(starts, n_past) :]
            starts.extend(range(n_past, n_past + len(tokens), self.n_batch))
        self.tokens_evaluated += len(tokens)
        try:
            super().eval(tokens)
        except RuntimeError:  # llama_decode returned an error code: 2 when it was aborted
            if not abort_requested():
                raise
            self._forget_unfinished(n_past + len(tokens))
            raise KeyboardInterrupt from None

    def _forget_unfinished(self, end: int) -> None:
        """After an aborted evaluation: the cache and the records end where the last whole
        batch did (llama.cpp keeps an aborted batch's finished micro-batches)."""
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        self.tokens_evaluated -= end - self.n_tokens
        starts = self.batch_starts
        if starts is not None:
            del starts[bisect.bisect_left(starts, self.n_tokens) :]
