"""Speculative decoding: draft the next tokens cheaply, and let one llama.cpp decode of
the big model verify them.

Two sources of drafts. Prompt lookup: the tokens that followed the latest earlier occurrence
of the context's last few tokens (free; right where a reply repeats its context: a file
returned with a change, a quote, code fixed in place). A draft model: a small model of the
same family writing ahead greedily (``draft_model.py``; a few small steps per big one).
Generation reads every weight once per step, so a step of several tokens costs less than
that many steps; where drafts are right tokens/s rises with the same output. The
verification is llama-cpp-python's own ``Llama.generate`` loop with a draft model (it
samples each position, keeps the drafts while they agree with what was sampled, and removes
the rejected cells); ``RecordingLlama`` evaluates the draft batch with every position's
logits, so nothing keeps ``logits_all``'s n_ctx x n_vocab floats.

Whether a draft pays depends on the machine: on 2 CPU cores a decode of 3 tokens costs
~2.2 single steps, on a GPU barely more than one. ``DraftPolicy`` measures both sides as it
goes — the cost of each step size (and of a draft model's step) and how many drafted tokens
are accepted from each source — and drafts only the length whose expected tokens per unit of
cost beat a plain step's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from llama_cpp.llama_speculative import LlamaDraftModel

from localchat.backends.llama.draft_policy import DEEP_MATCH, MODEL, Draft, DraftPolicy
from localchat.chat.prompt import common_prefix

if TYPE_CHECKING:
    from localchat.backends.llama.draft_model import DraftModel
    from localchat.backends.llama.recording import RecordingLlama

# The n-gram looked up, longest first: two tokens still find most copies, one finds noise.
NGRAM_SIZES = (4, 3, 2)


def lookup_draft(context: npt.NDArray[np.intc], limit: int) -> Draft:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the context's
    last n-gram (the longest of ``NGRAM_SIZES`` that occurs); no tokens when none does.
    Asked before every step of a drafting reply, most often to find nothing (prose): the
    ids are searched as bytes (``bytes.rfind``, in C): 4 us on a 400-token context where
    comparing arrays n-gram by n-gram took 26 us."""
    length = len(context)
    if limit <= 0:
        return Draft([])
    ids = np.ascontiguousarray(context, dtype=np.intc)
    raw = ids.tobytes()
    width = ids.itemsize
    for size in NGRAM_SIZES:
        if length <= size:
            continue
        start = _latest_earlier(raw, raw[-size * width :], length - size, width)
        if start is not None:
            following = [int(t) for t in ids[start + size : start + size + limit]]
            return Draft(
                following[: next((i for i, t in enumerate(following) if t < 0), limit)],
                _match_depth(ids, start + size, length),
            )
    return Draft([])


def _latest_earlier(raw: bytes, tail: bytes, before: int, width: int) -> int | None:
    """The latest token position under ``before`` where ``tail`` starts in ``raw`` (ids of
    ``width`` bytes): a byte match off a token boundary is skipped."""
    end = (before - 1) * width + len(tail)  # a match starting at ``before - 1`` ends here
    while True:
        found = raw.rfind(tail, 0, end)
        if found < 0:
            return None
        if found % width == 0:
            return found // width
        end = found + len(tail) - 1  # look further back, past this unaligned match


def _match_depth(context: npt.NDArray[np.intc], match_end: int, length: int) -> int:
    """How many tokens before ``match_end`` equal those before the context's end (at most
    ``DEEP_MATCH``)."""
    span = min(DEEP_MATCH, match_end)
    earlier = context[match_end - span : match_end][::-1]
    latest = context[length - span : length][::-1]
    differs = np.flatnonzero(earlier != latest)
    return int(differs[0]) if len(differs) else span


class Drafter(LlamaDraftModel):
    """The draft model ``Llama.generate`` calls before each step: prompt lookup (``lookup``)
    and a draft model (``model``), whichever the policy expects more of, cut to what it
    finds worth verifying and to the reply's remaining length. It counts what it drafted and
    what was accepted, and tells ``llm`` to evaluate the next batch with every position's
    logits."""

    def __init__(
        self,
        llm: RecordingLlama,
        policy: DraftPolicy,
        end: int,
        lookup: bool = True,
        model: DraftModel | None = None,
    ) -> None:
        self.llm = llm
        self.policy = policy
        self.end = end  # the context length where the reply must stop (max_tokens)
        self.lookup = lookup
        self.model = model
        self.drafted = 0
        self.accepted = 0
        self.steps = 0  # verifications
        self._started = False  # the first call follows the prompt's evaluation, not a step
        self._last: tuple[int, Draft] | None = None  # where the last draft went, and it

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        self._learn(input_ids)
        room = min(self.end - len(input_ids), self.policy.max_draft)
        draft = self._choose(input_ids, room)
        if not draft.tokens:
            self.policy.idle_step()
            self._last = None
            return np.array([], dtype=np.intc)
        self._last = (len(input_ids), draft)
        self.drafted += len(draft.tokens)
        self.steps += 1
        self.llm.verify_next = len(draft.tokens) + 1  # the sampled token and its drafts
        return np.array(draft.tokens, dtype=np.intc)

    def _choose(self, context: npt.NDArray[np.intc], room: int) -> Draft:
        """The draft worth the most expected tokens per unit of cost: a lookup match (free),
        or the draft model's greedy run (each token a small step)."""
        policy = self.policy
        # The draft model reads the context too: not one with an image's placeholders.
        model = self.model if self.model is not None and context.min(initial=0) >= 0 else None
        if model is not None and policy.wants_single_step():
            return Draft([])  # a plain step, timed: what the draft model's cost is counted in
        found = lookup_draft(context, room) if self.lookup else Draft([])
        length, gain = policy.best_length(found.kind, len(found.tokens))
        if model is not None and room > 0:
            step_cost = policy.model_step_cost(model.step_s)
            model_length, model_gain = policy.best_length(MODEL, room, step_cost)
            if model_length and model_gain > gain:
                tokens = model.draft(context, model_length)
                if not tokens:  # unsure of its first token: a draft that failed, for the policy
                    policy.record_verification(MODEL, 1, 0)
                return Draft(tokens, from_model=True)
        return Draft(found.tokens[:length], found.depth)

    def speedup(self, gen_tps: float) -> float | None:
        """``gen_tps`` against what single steps would have given at their measured cost
        (None: nothing was drafted, or no single step was timed)."""
        single = self.policy.step_s.get(1)
        if not self.drafted or not single or gen_tps <= 0:
            return None
        return gen_tps * single

    def finish(self, sequence: list[int]) -> None:
        """The reply ended (``sequence``: the prompt and the reply as kept): count the last
        draft's accepted tokens."""
        self._count_accepted(np.array(sequence, dtype=np.intc))

    def _learn(self, context: npt.NDArray[np.intc]) -> None:
        """The step just taken: its cost, and how much of the last draft the model kept."""
        if self._started:
            self.policy.record_step(*self.llm.last_eval)
        self._started = True
        self._count_accepted(context)

    def _count_accepted(self, context: npt.NDArray[np.intc]) -> None:
        if self._last is None:
            return
        start, draft = self._last
        kept = [int(t) for t in context[start : start + len(draft.tokens)]]
        accepted = common_prefix(kept, draft.tokens)
        if accepted == len(kept) < len(draft.tokens):  # the reply ended inside the draft
            self.drafted -= len(draft.tokens) - len(kept)  # the rest was never tried
            draft = replace(draft, tokens=draft.tokens[: len(kept)])
        self.accepted += accepted
        self.policy.record_verification(draft.kind, len(draft.tokens), accepted)
        self._last = None
