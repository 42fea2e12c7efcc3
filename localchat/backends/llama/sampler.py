"""One sequence's sampler: llama.cpp's sampler chain as llama-cpp-python orders it for a
single reply, and a grammar (structured output, a required tool call) where one holds the
reply — judged only over the tokens that could be chosen.

llama.cpp's grammar sampler costs about 8 ms a token on a 49k vocabulary (each candidate's
text is matched against the grammar's stacks): more than a 135M model's whole step. Which
token wins is settled by the highest logits, so a greedy reply has the grammar judge the
best token alone, then where it is refused the best ``CANDIDATES`` (after penalties and
biases), and the whole vocabulary only where none of those passes: the token the grammar
over the whole vocabulary gives. A sampled reply is
drawn as llama-server draws it: freely first, kept where the grammar allows that token,
else drawn again among the allowed ones (judged over the best candidates where at least
``top_k`` of them pass, which is then the same set).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp
import numpy as np

from localchat.backends.base import Sampling
from localchat.backends.llama.grammar import checked_grammar

PENALTY_LAST_N = 64  # tokens a repetition penalty looks back over (llama.cpp's default)
CANDIDATES = (64, 1024, 8192)  # the best tokens a grammar judges, more where too few pass

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class SequenceSampler:
    """Penalties, top-k, top-p, min-p, temperature and a seeded draw (greedy at temperature
    0), after a grammar where one is given; ``sample`` picks, and every part remembers the
    token (penalties look back, a grammar moves on)."""

    def __init__(
        self,
        sampling: Sampling,
        n_vocab: int,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        grammar: tuple[object, str] | None = None,
        logit_bias: Sequence[tuple[int, float]] = (),
    ) -> None:
        self._n_vocab = n_vocab
        self._grammar = None
        self._chains: list[object] = []
        if grammar is not None:
            vocab, rules = grammar
            checked_grammar(vocab, rules)
            self._grammar = llama_cpp.llama_sampler_init_grammar(vocab, rules.encode(), b"root")
        adjust = _adjusting(n_vocab, sampling, frequency_penalty, presence_penalty, logit_bias)
        choose = _choosing(sampling)
        if self._grammar is None:  # one chain: llama.cpp fills and samples in C
            self._chain = self._new_chain(adjust + choose)
            return
        self._adjust = self._new_chain(adjust) if adjust else None
        self._choose = self._new_chain(choose)
        # What must pass the grammar for the choice to be the whole vocabulary's.
        self._greedy = sampling.temperature <= 0
        self._needed = 1 if self._greedy else sampling.top_k
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._single = np.zeros(1, dtype=_TOKEN_DATA)
        self._single_array = llama_cpp.llama_token_data_array(
            self._single.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), 1, -1, False
        )
        self._logits: tuple[int, np.ndarray] = (0, self._all["logit"])  # address, its view

    def _new_chain(self, samplers: list[object]) -> object:
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for sampler in samplers:
            llama_cpp.llama_sampler_chain_add(chain, sampler)
        self._chains.append(chain)
        return chain

    def sample(self, ctx: object, row: int) -> int:
        """The next token from ``row``'s logits in ``ctx``; the samplers remember it."""
        if self._grammar is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, row))
        logits = self._logits_of(ctx, row)
        if self._greedy and self._adjust is None:
            # The best logit, the first of equals as llama.cpp's greedy sampler takes it:
            # usually allowed, and then one token was judged.
            token = int(np.argmax(logits))
            if not self._allows(token):
                token = self._held_choice(logits, None)
        else:
            everything = self._whole(logits)
            if self._adjust is not None:
                _apply(self._adjust, everything)
            token = -1 if self._greedy else _apply(self._choose, everything.copy())
            if token < 0 or not self._allows(token):
                token = self._held_choice(everything["logit"], everything)
        for part in (self._grammar, self._adjust, self._choose):
            if part is not None:
                llama_cpp.llama_sampler_accept(part, token)
        return token

    def _logits_of(self, ctx: object, row: int) -> np.ndarray:
        """``row``'s logits in ``ctx``, read in place (the view is kept while llama.cpp's
        buffer stays where it is: making one costs more than the greedy choice)."""
        pointer = llama_cpp.llama_get_logits_ith(ctx, row)
        address = ctypes.cast(pointer, ctypes.c_void_p).value or 0
        if not address:
            raise RuntimeError(f"llama.cpp has no logits for row {row}")
        if address != self._logits[0]:
            view = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))
            self._logits = (address, view)
        return self._logits[1]

    def _held_choice(self, logits: np.ndarray, everything: np.ndarray | None) -> int:
        """The chain's pick among the tokens the grammar allows, judged over the best
        candidates first, over all where too few of those pass (``everything``: the whole
        vocabulary as token data, made here from ``logits`` where not given)."""
        if self._needed > 0:
            for count in CANDIDATES:
                if count >= self._n_vocab:
                    break
                best = _best_ids(logits, count)
                some = np.zeros(len(best), dtype=_TOKEN_DATA)
                some["id"], some["logit"] = best, logits[best]
                _apply(self._grammar, some)
                if np.isfinite(some["logit"]).sum() >= self._needed:
                    return _apply(self._choose, some)
        if everything is None:
            everything = self._whole(logits)
        _apply(self._grammar, everything)
        return _apply(self._choose, everything)

    def _whole(self, logits: np.ndarray) -> np.ndarray:
        """The whole vocabulary as token data for ``logits`` (refilled each time: a chain
        may have sorted it in place)."""
        everything = self._all
        everything["id"], everything["logit"], everything["p"] = self._ids, logits, 0.0
        return everything

    def _allows(self, token: int) -> bool:
        """Whether the grammar lets ``token`` come next."""
        single, array = self._single, self._single_array
        single["id"], single["logit"] = token, 0.0
        array.size, array.selected, array.sorted = 1, -1, False
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(array))
        return bool(np.isfinite(single["logit"][0]))

    def close(self) -> None:
        for chain in self._chains:
            llama_cpp.llama_sampler_free(chain)
        self._chains = []
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


def _best_ids(logits: np.ndarray, count: int) -> np.ndarray:
    """At least ``count`` ids of the highest ``logits`` (all at or above a threshold, so
    ties at its edge are all in), best first, the lower id first among equals (as
    llama.cpp's greedy choice over the whole vocabulary takes them). A threshold found by
    doubling a gap below the best: a few passes of a comparison, where numpy's
    argpartition over 49k logits took 0.5 ms, a tenth of a 135M model's step."""
    top = float(logits.max())
    low, gap = 0.0, 1.0
    ids = np.flatnonzero(logits >= top - gap)
    while len(ids) < count and gap < 1e6:
        low, gap = gap, gap * 2
        ids = np.flatnonzero(logits >= top - gap)
    for _ in range(12):  # far too many: narrow the gap between one too few and this one
        if len(ids) <= 2 * count:
            break
        middle = (low + gap) / 2
        narrower = np.flatnonzero(logits >= top - middle)
        if len(narrower) >= count:
            ids, gap = narrower, middle
        else:
            low = middle
    if len(ids) < count:  # -inf logits (a bias that forbids): every one is a candidate
        ids = np.arange(len(logits))
    return ids[np.argsort(-logits[ids], kind="stable")]


def _apply(sampler: object, candidates: np.ndarray) -> int:
    """Run ``sampler`` over ``candidates`` (in place); the token it selected, or -1."""
    data = candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
    array = llama_cpp.llama_token_data_array(data, len(candidates), -1, False)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    return -1 if array.selected < 0 else int(array.data[array.selected].id)


def _adjusting(
    n_vocab: int,
    sampling: Sampling,
    frequency_penalty: float,
    presence_penalty: float,
    logit_bias: Sequence[tuple[int, float]],
) -> list[object]:
    """The samplers that move logits before any choice: OpenAI's logit bias, then the
    repetition penalties."""
    samplers = []
    if logit_bias:
        entries = [llama_cpp.llama_logit_bias(token, bias) for token, bias in logit_bias]
        biases = (llama_cpp.llama_logit_bias * len(entries))(*entries)
        samplers.append(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(entries), biases))
    if sampling.repeat_penalty != 1.0 or frequency_penalty or presence_penalty:
        samplers.append(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,  # as llama-cpp-python's binding declares it
                PENALTY_LAST_N,
                sampling.repeat_penalty,
                frequency_penalty,
                presence_penalty,
            )
        )
    return samplers


def _choosing(sampling: Sampling) -> list[object]:
    """The samplers that narrow and draw: greedy at temperature 0, else top-k, top-p,
    min-p, temperature and a seeded draw."""
    if sampling.temperature <= 0:
        return [llama_cpp.llama_sampler_init_greedy()]
    samplers = []
    if sampling.top_k > 0:
        samplers.append(llama_cpp.llama_sampler_init_top_k(sampling.top_k))
    samplers += [
        llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1),
        llama_cpp.llama_sampler_init_min_p(sampling.min_p, 1),
        llama_cpp.llama_sampler_init_temp(sampling.temperature),
        llama_cpp.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF),
    ]
    return samplers
