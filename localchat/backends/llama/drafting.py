"""Speculative decoding by prompt lookup: draft the tokens that followed the latest earlier
occurrence of the context's last few tokens, and let one llama.cpp decode verify them.

Generation reads every weight once per step, so a step of several tokens costs less than
that many steps; where a reply repeats its context (a file returned with a change, a quote,
code fixed in place) the drafts are right and tokens/s rises with the same output. The
verification is llama-cpp-python's own ``Llama.generate`` loop with a draft model (it
samples each position, keeps the drafts while they agree with what was sampled, and removes
the rejected cells); ``RecordingLlama`` evaluates the draft batch with every position's
logits, so nothing keeps ``logits_all``'s n_ctx x n_vocab floats.

Whether a draft pays depends on the machine: on 2 CPU cores a decode of 3 tokens costs
~2.2 single steps, on a GPU barely more than one. ``DraftPolicy`` measures both sides as it
goes — the cost of each step size and how many drafted tokens are accepted — and drafts only
the length whose expected tokens per step beat a plain step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from llama_cpp.llama_speculative import LlamaDraftModel

from localchat.chat.prompt import common_prefix

if TYPE_CHECKING:
    from localchat.backends.llama.recording import RecordingLlama

# The n-gram looked up, longest first: two tokens still find most copies, one finds noise.
NGRAM_SIZES = (4, 3, 2)
MAX_DRAFT = 8
# A match this many tokens deep (the context before the n-gram matching too) is a copy in
# progress; shallower ones are often a phrase that recurs. Each kind keeps its own
# acceptance: per drafted token, the chance it is accepted, starting from these priors.
DEEP_MATCH = 8
PRIOR_ACCEPTANCE = {True: 0.85, False: 0.6}  # deep, shallow
ACCEPTANCE_WEIGHT = 0.3  # of the newest verification in the running acceptance
# While not drafting, the acceptance drifts back toward the prior by this share a step, so
# a turn whose drafts failed tries again now and then (a reply turns from prose to a copy).
RECOVERY = 0.05
COST_WEIGHT = 0.3  # of the newest timing in each step size's running cost
# A step of n tokens, before it is measured, costs this many single steps per extra token
# (2 CPU cores: 1.75x for 2 tokens, 2.2x for 3, 3.2x for 5; a GPU is nearly flat).
PRIOR_EXTRA_TOKEN_COST = 0.6
MIN_GAIN = 1.05  # expected tokens per unit of a single step's cost, to be worth a draft


@dataclass(frozen=True)
class Draft:
    """Tokens that followed an earlier occurrence of the context's tail, and how deep that
    occurrence matched (tokens before it equal to the tail's, up to ``DEEP_MATCH``)."""

    tokens: list[int]
    depth: int = 0

    @property
    def deep(self) -> bool:
        return self.depth >= DEEP_MATCH


def lookup_draft(context: npt.NDArray[np.intc], limit: int) -> Draft:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the context's
    last n-gram (the longest of ``NGRAM_SIZES`` that occurs); no tokens when none does."""
    length = len(context)
    if limit <= 0:
        return Draft([])
    for size in NGRAM_SIZES:
        if length <= size:
            continue
        tail = context[-size:]
        # Start positions whose n-gram equals the tail, the tail itself excluded.
        matches = np.ones(length - size, dtype=bool)
        for offset in range(size):
            matches &= context[offset : length - size + offset] == tail[offset]
        found = np.flatnonzero(matches)
        if len(found):
            start = int(found[-1])
            return Draft(
                [int(t) for t in context[start + size : start + size + limit]],
                _match_depth(context, start + size, length),
            )
    return Draft([])


def _match_depth(context: npt.NDArray[np.intc], match_end: int, length: int) -> int:
    """How many tokens before ``match_end`` equal those before the context's end (at most
    ``DEEP_MATCH``)."""
    span = min(DEEP_MATCH, match_end)
    earlier = context[match_end - span : match_end][::-1]
    latest = context[length - span : length][::-1]
    differs = np.flatnonzero(earlier != latest)
    return int(differs[0]) if len(differs) else span


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Tokens a step yields on average with ``drafted`` drafts, each accepted with this
    chance while the ones before it were: the accepted run plus the model's own token."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


@dataclass
class DraftPolicy:
    """How long a draft to verify: measured step costs and acceptance (for deep and shallow
    matches apart), the best expected tokens per unit of cost, or none where a plain step is
    as good."""

    max_draft: int = MAX_DRAFT
    acceptance: dict[bool, float] = field(default_factory=lambda: dict(PRIOR_ACCEPTANCE))
    step_s: dict[int, float] = field(default_factory=dict)  # tokens in a step -> seconds

    def reset_acceptance(self) -> None:
        """A new reply: it repeats its context more or less than the last one did."""
        self.acceptance = dict(PRIOR_ACCEPTANCE)

    def record_step(self, n_tokens: int, seconds: float) -> None:
        """A generation step of ``n_tokens`` took ``seconds`` (the prompt is not one)."""
        if not 1 <= n_tokens <= self.max_draft + 1 or seconds <= 0:
            return
        before = self.step_s.get(n_tokens)
        self.step_s[n_tokens] = (
            seconds if before is None else before + COST_WEIGHT * (seconds - before)
        )

    def record_verification(self, deep: bool, drafted: int, accepted: int) -> None:
        """Of ``drafted`` tokens from a deep or a shallow match, the first ``accepted`` were
        kept."""
        if drafted <= 0:
            return
        # Per token: accepted ones passed; the first rejected failed; later ones were
        # never tried, so they say nothing.
        tried = accepted + (1 if accepted < drafted else 0)
        rate = accepted / tried
        self.acceptance[deep] += ACCEPTANCE_WEIGHT * (rate - self.acceptance[deep])

    def idle_step(self) -> None:
        """A step without a draft: the acceptances drift back toward their priors."""
        for deep, prior in PRIOR_ACCEPTANCE.items():
            self.acceptance[deep] += RECOVERY * (prior - self.acceptance[deep])

    def cost(self, n_tokens: int) -> float:
        """A step of ``n_tokens`` in units of a single-token step: measured, else
        interpolated between measured sizes, else the prior's slope from one token."""
        single = self.step_s.get(1)
        if single is None or n_tokens == 1:
            return 1.0 + PRIOR_EXTRA_TOKEN_COST * (n_tokens - 1)
        if n_tokens in self.step_s:
            return self.step_s[n_tokens] / single
        known = sorted(self.step_s)
        below = max(n for n in known if n < n_tokens)
        above = [n for n in known if n > n_tokens]
        low = self.step_s[below] / single
        if above:
            high = self.step_s[above[0]] / single
            share = (n_tokens - below) / (above[0] - below)
            return low + share * (high - low)
        # Past the largest measured: its slope per token, never below half the prior's.
        slope = (low - 1.0) / (below - 1) if below > 1 else PRIOR_EXTRA_TOKEN_COST
        return low + max(slope, PRIOR_EXTRA_TOKEN_COST / 2) * (n_tokens - below)

    def draft_length(self, draft: Draft) -> int:
        """How many of the draft's tokens to verify (0: a plain step pays more)."""
        acceptance = self.acceptance[draft.deep]
        best, best_gain = 0, MIN_GAIN
        for drafted in range(1, min(len(draft.tokens), self.max_draft) + 1):
            gain = expected_tokens(acceptance, drafted) / self.cost(drafted + 1)
            if gain > best_gain:
                best, best_gain = drafted, gain
        return best


class PromptLookupDrafter(LlamaDraftModel):
    """The draft model ``Llama.generate`` calls before each step: prompt lookup, cut to what
    the policy finds worth verifying and to the reply's remaining length. It counts what it
    drafted and what was accepted, and tells ``llm`` to evaluate the next batch with every
    position's logits."""

    def __init__(self, llm: RecordingLlama, policy: DraftPolicy, end: int) -> None:
        self.llm = llm
        self.policy = policy
        self.end = end  # the context length where the reply must stop (max_tokens)
        self.drafted = 0
        self.accepted = 0
        self.steps = 0  # verifications
        self._started = False  # the first call follows the prompt's evaluation, not a step
        self._last: tuple[int, Draft] | None = None  # where the last draft went, and it

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        self._learn(input_ids)
        room = self.end - len(input_ids)
        found = lookup_draft(input_ids, min(room, self.policy.max_draft))
        draft = Draft(found.tokens[: self.policy.draft_length(found)], found.depth)
        if not draft.tokens:
            self.policy.idle_step()
            self._last = None
            return np.array([], dtype=np.intc)
        self._last = (len(input_ids), draft)
        self.drafted += len(draft.tokens)
        self.steps += 1
        self.llm.verify_next = len(draft.tokens) + 1  # the sampled token and its drafts
        return np.array(draft.tokens, dtype=np.intc)

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
            draft = Draft(draft.tokens[: len(kept)], draft.depth)
        self.accepted += accepted
        self.policy.record_verification(draft.deep, len(draft.tokens), accepted)
        self._last = None
