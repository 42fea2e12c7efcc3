"""The one module that reaches into llama-cpp-python's private attributes.

``Llama`` wraps llama.cpp's model, context and batch (``_model``, ``_ctx``, ``_batch``) and
keeps a flag of its own (``_requires_eval``); a few things localchat needs have no public
API on it. Each is a small function here, its docstring saying what is missing, so a new
llama-cpp-python release that renames one breaks this module alone (``tests/test_layers.py``
holds every other module to that).
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp
import numpy as np
import numpy.typing as npt

# The private attributes of llama-cpp-python's objects that only this module touches.
PRIVATE_ATTRIBUTES = frozenset({"_model", "_ctx", "_batch", "_requires_eval", "_logits_all"})


def vocab_of(llm: llama_cpp.Llama) -> llama_cpp.llama_vocab_p:
    """The model's vocabulary pointer, as ``Llama`` keeps it: the public route is a C call
    (``llama_model_get_vocab``) on every use, and a reply asks for it on every token."""
    vocab: llama_cpp.llama_vocab_p = llm._model.vocab
    return vocab


def drop_cells_from(llm: llama_cpp.Llama, start: int) -> None:
    """Remove every cached cell from position ``start`` on: ``Llama.reset`` only rewinds its
    token count, and ``Llama`` has no public cut of llama.cpp's memory."""
    llm._ctx.kv_cache_seq_rm(-1, start, -1)


def eval_behind(llm: llama_cpp.Llama, tokens: Sequence[int], behind: int) -> None:
    """``Llama.eval`` with each token's position ``behind`` less than its index: after an
    M-RoPE image, whose cells take fewer positions than there are of them, text goes on
    from the position after the image, as libmtmd's helper places it. ``Llama.eval`` puts
    every token at its index, and has no way to say otherwise."""
    llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens - behind, -1)
    for i in range(0, len(tokens), llm.n_batch):
        batch = list(tokens[i : i + llm.n_batch])
        n_past = llm.n_tokens
        llm._batch.set_batch(batch=batch, n_past=n_past - behind, logits_all=llm._logits_all)
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past : n_past + len(batch)] = batch
        if llm._logits_all:
            rows = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(batch) * llm.n_vocab(),))
            llm.scores[n_past : n_past + len(batch), :].reshape(-1)[::] = rows
        llm.n_tokens += len(batch)
        llm._requires_eval = False


def fill_batch_every_position(llm: llama_cpp.Llama, tokens: Sequence[int], n_past: int) -> None:
    """Put ``tokens`` after ``n_past`` into ``Llama``'s own batch, every position asking for
    logits: ``Llama.eval`` asks for a batch's last only, unless ``logits_all`` keeps
    n_ctx x n_vocab floats for the whole context."""
    llm._batch.set_batch(batch=list(tokens), n_past=n_past, logits_all=True)


def decode_filled_batch(llm: llama_cpp.Llama) -> None:
    """Decode what ``fill_batch_every_position`` put in the batch (``Llama`` has no public
    decode of its own batch; timed apart from the filling by the bench's step timings)."""
    llm._ctx.decode(llm._batch)


def set_logits_stale(llm: llama_cpp.Llama, stale: bool) -> None:
    """Tell ``Llama.generate`` whether the context's last logits still belong to the last
    cached token (False) or the token must be evaluated again before sampling (True):
    ``_requires_eval`` has no public setter, and a cut or a restored state leaves it wrong."""
    llm._requires_eval = stale


def logits_stale(llm: llama_cpp.Llama) -> bool:
    """Whether ``Llama.generate`` would evaluate the last cached token again before sampling
    (``set_logits_stale``): no public getter either."""
    return bool(llm._requires_eval)


def last_logits(llm: llama_cpp.Llama, n_vocab: int) -> npt.NDArray[np.float32]:
    """The last decoded position's logits, without a copy: ``Llama.scores`` holds them only
    for the tokens ``eval`` copied out, and the draft model evaluates past them."""
    pointer = llm._ctx.get_logits_ith(-1)
    logits: npt.NDArray[np.float32] = np.ctypeslib.as_array(pointer, shape=(n_vocab,))
    return logits
