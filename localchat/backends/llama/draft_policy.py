"""How long a draft to verify, from what drafting costs and how often drafts are kept: pure
arithmetic over measured figures, shared by the engine's drafter (``drafting.py``) and the
planner, which asks whether a draft model would pay on this machine."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DRAFT = 8
# A draft model's own context: it rebuilds from the conversation's last tokens when that
# fills (``draft_model.py``), so its cache stays small whatever the big model's context.
DRAFT_CTX = 4096
# A match this many tokens deep (the context before the n-gram matching too) is a copy in
# progress; shallower ones are often a phrase that recurs. Each kind keeps its own
# acceptance: per drafted token, the chance it is accepted, starting from these priors (a
# draft model of the same family agrees with its big one most of the time).
DEEP_MATCH = 8
DEEP, SHALLOW, MODEL = "deep", "shallow", "model"  # where a draft came from
PRIOR_ACCEPTANCE = {DEEP: 0.85, SHALLOW: 0.6, MODEL: 0.7}
ACCEPTANCE_WEIGHT = 0.3  # of the newest verification in the running acceptance
# While not drafting, the acceptance drifts back toward the prior by this share a step, so
# a turn whose drafts failed tries again now and then (a reply turns from prose to a copy).
RECOVERY = 0.05
COST_WEIGHT = 0.3  # of the newest timing in each step size's running cost
# A step of n tokens, before it is measured or calibrated, costs this many single steps per
# extra token (2 CPU cores, SmolLM2: 1.75x for 2 tokens, 2.2x for 3, 3.2x for 5; a GPU is
# nearly flat).
PRIOR_EXTRA_TOKEN_COST = 0.6
PRIOR_STEP_COSTS = {1: 1.0, 2: 1.0 + PRIOR_EXTRA_TOKEN_COST}  # linear past the last size
# A draft model's step in big-model steps, before both are measured (a 0.5B for a 7B).
PRIOR_MODEL_STEP_COST = 0.15
MIN_GAIN = 1.05  # expected tokens per unit of a single step's cost, to be worth a draft
# A draft model may draft at every step, so no plain step would ever be timed: one in this
# many is taken plain, to keep the unit every cost is counted in measured.
SINGLE_STEP_EVERY = 32


@dataclass(frozen=True)
class Draft:
    """Drafted tokens: those that followed an earlier occurrence of the context's tail, with
    how deep that occurrence matched (tokens before it equal to the tail's, up to
    ``DEEP_MATCH``), or a draft model's (``from_model``)."""

    tokens: list[int]
    depth: int = 0
    from_model: bool = False

    @property
    def deep(self) -> bool:
        return self.depth >= DEEP_MATCH

    @property
    def kind(self) -> str:
        """Which acceptance it is judged by: ``MODEL``, ``DEEP`` or ``SHALLOW``."""
        if self.from_model:
            return MODEL
        return DEEP if self.deep else SHALLOW


def _on_curve(costs: dict[int, float], n_tokens: int, min_slope: float = 0.0) -> float:
    """``costs`` (step sizes to cost, 1 among them) at ``n_tokens``: itself, linear between
    the sizes around it, or past the largest at its mean slope from one token (at least
    ``min_slope``)."""
    if n_tokens in costs:
        return costs[n_tokens]
    below = max(n for n in costs if n < n_tokens)
    above = [n for n in sorted(costs) if n > n_tokens]
    if above:
        share = (n_tokens - below) / (above[0] - below)
        return costs[below] + share * (costs[above[0]] - costs[below])
    slope = (costs[below] - costs[1]) / (below - 1) if below > 1 else 0.0
    return costs[below] + max(slope, min_slope) * (n_tokens - below)


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Tokens a step yields on average with ``drafted`` drafts, each accepted with this
    chance while the ones before it were: the accepted run plus the model's own token."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


@dataclass
class DraftPolicy:
    """How long a draft to verify: measured step costs and acceptance (for deep and shallow
    matches and a draft model's apart), the best expected tokens per unit of cost, or none
    where a plain step is as good."""

    max_draft: int = MAX_DRAFT
    acceptance: dict[str, float] = field(default_factory=lambda: dict(PRIOR_ACCEPTANCE))
    step_s: dict[int, float] = field(default_factory=dict)  # tokens in a step -> seconds
    steps_since_single: int = 0
    # Until steps are timed: a step's cost in single steps by its tokens (the calibration's
    # curve for this model: ``SpeedModel.step_costs``), and a draft model's step in
    # big-model steps (the calibration's predicted speeds of both).
    prior_costs: dict[int, float] = field(default_factory=lambda: dict(PRIOR_STEP_COSTS))
    prior_model_step: float = PRIOR_MODEL_STEP_COST
    # The largest step timed: a server's steps carry every sequence's tokens.
    max_step: int = MAX_DRAFT + 1

    def reset_acceptance(self) -> None:
        """A new reply: it repeats its context more or less than the last one did."""
        self.acceptance = dict(PRIOR_ACCEPTANCE)

    def record_step(self, n_tokens: int, seconds: float) -> None:
        """A generation step of ``n_tokens`` took ``seconds`` (the prompt is not one)."""
        if not 1 <= n_tokens <= self.max_step or seconds <= 0:
            return
        self.steps_since_single = 0 if n_tokens == 1 else self.steps_since_single + 1
        before = self.step_s.get(n_tokens)
        self.step_s[n_tokens] = (
            seconds if before is None else before + COST_WEIGHT * (seconds - before)
        )

    def wants_single_step(self) -> bool:
        """Whether the next step should go plain: a single step was never timed, or not for
        ``SINGLE_STEP_EVERY`` steps."""
        return 1 not in self.step_s or self.steps_since_single >= SINGLE_STEP_EVERY

    def record_verification(self, kind: str, drafted: int, accepted: int) -> None:
        """Of ``drafted`` tokens of a kind (``Draft.kind``), the first ``accepted`` were
        kept."""
        if drafted <= 0:
            return
        # Per token: accepted ones passed; the first rejected failed; later ones were
        # never tried, so they say nothing.
        tried = accepted + (1 if accepted < drafted else 0)
        rate = accepted / tried
        self.acceptance[kind] += ACCEPTANCE_WEIGHT * (rate - self.acceptance[kind])

    def idle_step(self) -> None:
        """A step without a draft: the acceptances drift back toward their priors."""
        for kind, prior in PRIOR_ACCEPTANCE.items():
            self.acceptance[kind] += RECOVERY * (prior - self.acceptance[kind])

    def cost(self, n_tokens: int) -> float:
        """A step of ``n_tokens`` in units of a single-token step: measured, else
        interpolated between measured sizes, else the calibration's curve (``prior_costs``)."""
        single = self.step_s.get(1)
        if single is None or n_tokens == 1:
            return self.prior_cost(n_tokens)
        measured = {n: step_s / single for n, step_s in self.step_s.items()}
        if n_tokens in measured:
            return measured[n_tokens]
        below = max(n for n in measured if n < n_tokens)
        if below == 1 and not any(n > n_tokens for n in measured):
            return self.prior_cost(n_tokens)
        # Past the largest measured: its slope per token, never below half the prior's.
        floor = (self.prior_cost(n_tokens) - self.prior_cost(below)) / (2 * (n_tokens - below))
        return _on_curve(measured, n_tokens, floor)

    def prior_cost(self, n_tokens: int) -> float:
        """The calibration's (or the default) cost of a step of ``n_tokens``."""
        return _on_curve(self.prior_costs, n_tokens)

    def draft_length(self, draft: Draft) -> int:
        """How many of the draft's tokens to verify (0: a plain step pays more)."""
        return self.best_length(draft.kind, len(draft.tokens))[0]

    def best_length(
        self, kind: str, available: int, step_cost: float = 0.0, base: int = 1
    ) -> tuple[int, float]:
        """The draft length of ``kind`` (at most ``available``) with the most expected tokens
        per unit of cost, and that gain; (0, MIN_GAIN) where no length beats a plain step.
        ``step_cost``: what drafting each token costs, in big-model steps (a draft model's);
        ``base``: the tokens the step carries without this draft (a server's other
        sequences, and this one's token), whose cost the draft adds to."""
        acceptance = self.acceptance[kind]
        best, best_gain = 0, MIN_GAIN
        plain = self.cost(base)
        for drafted in range(1, min(available, self.max_draft) + 1):
            cost = self.cost(base + drafted) / plain + drafted * step_cost
            gain = expected_tokens(acceptance, drafted) / cost
            if gain > best_gain:
                best, best_gain = drafted, gain
        return best, best_gain

    def model_step_cost(self, model_step_s: float | None) -> float:
        """A draft model's step in big-model steps: measured, else the prior."""
        single = self.step_s.get(1)
        if model_step_s is None or not single:
            return self.prior_model_step
        return model_step_s / single
