"""``bench --only spec``: speculative decoding by prompt lookup on the real SmolLM2 at an 8k
context — a reply that returns an attached file with one function renamed (drafts mostly
right), and an open-ended story (drafts mostly absent or wrong) — tokens/s with drafting
over without, the same greedy text required.

One engine runs both sides, drafting switched on and off between turns (``Engine.drafting``):
the same weights, buffers and CPU caches on both, where two engines' turns had each start
with the other's weights in the CPU's cache. It runs flash attention over a q8_0 KV cache:
there llama.cpp gives a batch the logits single steps would, so ``auto`` drafts and the
replies are exactly the same (with an F16 cache a single token past 512 cells takes another
kernel path, and ``auto`` does not draft). The engine starts from this machine's calibrated
step costs, as ``ModelLoader.load`` gives the app and ``serve`` (the calibrate part saved
them). The ceiling is what the measured acceptance and step costs allow: the reply's tokens
over what its steps cost in single steps (plain steps, and verifications at the measured
cost of a step of the mean draft length plus one). ``spec_copy_possible`` bounds any drafting:
the best k over what a step of k tokens costs in single steps, the larger of two readings -
steps of 1-9 tokens timed bare on the model right after, on a cache like the part's (its
size and type, the copy's mean fill), and the drafting engine's own step costs from the
turns. Where even that is too low for the speedup target (the model computes from the CPU's
cache and a step of k costs about k), the target is reported but not judged
(``bench/run.py``).

Draft models: a generated 1B-shaped model with its 0.5B-shaped sibling as the draft (the same
vocabulary, random weights: drafts that fail or are never sure), tokens/s over the same
model without: ``spec_draft_failing_ratio``, what a draft model that does not help costs
(the engine must soon stop asking it), the same greedy text required.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import Progress, say
from localchat.cpu import physical_cores

if TYPE_CHECKING:
    from localchat.backends.base import TurnStats
    from localchat.backends.llama.engine import Engine

SPEC_CTX = 8192
SPEC_KV = "q8_0"
SPEC_TOKENS = 320  # the copy: the whole file (~230 tokens) and what follows it
# Prose: this host's speed moves by 10-15% from one second to the next (a plain turn's
# median step took 6.5 ms, then 9 ms a second later), so a pair of 1-second turns swung
# +-15%. Pairs of short turns sit closer in time: 21 pairs of 40 tokens read the plain
# engine against itself at 0.99-1.00 where 7 pairs of 120 read 0.97-1.01 (the same time).
PROSE_TOKENS = 40
# A copy turn (~230 tokens, 2-3 s) swings with the host by up to a fifth against its pair
# (78 tok/s drafting, 100 plain, then 94 and 95): five pairs, so one such does not decide.
COPY_ROUNDS = 5
PROSE_ROUNDS = 21
DRAFT_TOKENS = 64
DRAFT_ROUNDS = 2  # the failing draft model: the policy declines it, the ratio sits at 1.0
DRAFT_SHAPES = ("1b", "0.5b")  # the model, its draft (the same generated vocabulary)
SOURCE = '''import csv
from pathlib import Path


def load_rows(path):
    """The rows of a CSV file, comments and blank lines skipped."""
    rows = []
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if row and not row[0].startswith("#"):
                rows.append(row)
    return rows


def total_of(rows, column):
    total = 0.0
    for row in rows:
        total += float(row[column])
    return total


def average_of(rows, column):
    if not rows:
        return 0.0
    return total_of(rows, column) / len(rows)


def report(path, column):
    rows = load_rows(Path(path))
    print(f"{len(rows)} rows, total {total_of(rows, column):.2f}")
    print(f"average {average_of(rows, column):.2f}")
'''
COPY_PROMPT = (
    f"Here is report.py:\n\n```python\n{SOURCE}```\n\n"
    "Rename the function total_of to sum_column everywhere and return the whole file."
)
PROSE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _turn(engine: Engine, prompt: str, max_tokens: int) -> tuple[str, TurnStats]:
    from localchat.backends.base import Sampling
    from localchat.chat.template import ChatMessage

    engine.cache.reset()
    generation = engine.generate(
        engine.prompt_tokens([ChatMessage("user", prompt)]), Sampling(temperature=0.0), max_tokens
    )
    for _ in generation:
        pass
    return generation.text, generation.stats


def _compare(
    engine: Engine, prompt: str, rounds: int, max_tokens: int, label: str, progress: Progress
) -> tuple[list[float], TurnStats, bool]:
    """Per-round ratios of tokens/s (drafting over plain, the order alternating), the last
    drafted turn's stats, and whether every pair of replies was the same text."""
    ratios: list[float] = []
    same = True
    stats: TurnStats | None = None
    try:
        for index in range(rounds):
            turns: dict[bool, tuple[str, TurnStats]] = {}
            for drafting in (False, True) if index % 2 == 0 else (True, False):
                engine.drafting = drafting
                turns[drafting] = _turn(engine, prompt, max_tokens)
            (plain_text, plain_stats), (text, stats) = turns[False], turns[True]
            same = same and text == plain_text
            ratios.append(stats.gen_tps / plain_stats.gen_tps)
            say(progress, f"spec: {label} round {index + 1}: {stats.gen_tps:.1f} tok/s"
                 f" drafting, {plain_stats.gen_tps:.1f} plain")  # fmt: skip
    finally:
        engine.drafting = True
    assert stats is not None
    return ratios, stats, same


def bench_spec(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Copy and prose turns on SmolLM2 with and without drafts (``model_path`` is not used:
    prompt lookup needs a model that copies, not random weights)."""
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.models.speed import calibrated_step_costs
    from localchat.models.starter import ensure_starter
    from localchat.paths import app_paths

    starter = ensure_starter(app_paths(), hub=False)
    if not starter.real:
        return {"spec_skipped": f"SmolLM2 could not be had: {starter.note}"}
    say(progress, f"spec: SmolLM2 at {SPEC_CTX} context, KV {SPEC_KV}, with and without drafts")

    options = LoadOptions(
        n_ctx=SPEC_CTX,
        n_threads=physical_cores(),
        kv_type=SPEC_KV,
        speculative="auto",
        step_costs=calibrated_step_costs(app_paths().speed_calibration, starter.path),
    )
    engine = Engine(starter.path, options)
    try:
        if not engine.drafting:
            raise RuntimeError(f"SmolLM2 does not draft with a {SPEC_KV} cache here")
        copy, copy_stats, copy_same = _compare(
            engine, COPY_PROMPT, COPY_ROUNDS, SPEC_TOKENS, "copy", progress
        )
        prose, _prose_stats, prose_same = _compare(
            engine, PROSE_PROMPT, PROSE_ROUNDS, PROSE_TOKENS, "prose", progress
        )
        costs = engine.step_costs()
    finally:
        engine.close()
    bare = possible_speedup(
        starter.path, copy_stats.prompt_tokens + copy_stats.generated_tokens // 2
    )
    in_engine = max(n / cost for n, cost in costs.items())
    possible = max(bare, in_engine)
    say(progress, f"spec: drafting could give at most {possible:.2f}x on this model now")
    speedup = statistics.median(copy)
    ceiling, mean_draft = _ceiling(copy_stats, costs)
    return _draft_model_figures(progress) | {
        "spec_model": starter.path.name,
        "spec_kv_type": SPEC_KV,
        "spec_copy_speedup": round(speedup, 3),
        "spec_copy_ceiling": round(ceiling, 3),
        "spec_copy_of_ceiling": round(speedup / ceiling, 3),
        "spec_copy_possible": round(possible, 3),
        "spec_copy_possible_bare": round(bare, 3),
        "spec_copy_possible_engine": round(in_engine, 3),
        "spec_copy_acceptance": round(
            copy_stats.accepted_tokens / max(1, copy_stats.drafted_tokens), 3
        ),
        "spec_copy_mean_draft": round(mean_draft, 2),
        "spec_copy_tokens": copy_stats.generated_tokens,
        "spec_step_costs": {n: round(c, 3) for n, c in costs.items()},
        "spec_prose_ratio": round(statistics.median(prose), 3),
        "spec_replies_identical": copy_same and prose_same,
    }


def _draft_model_figures(progress: Progress) -> dict[str, Any]:
    """A draft model whose drafts fail: generation with it over without, same text."""
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.models.speed import calibrated_step_costs
    from localchat.models.timing_models import ensure_mix_model
    from localchat.paths import app_paths

    # Random blocks (made in seconds; the plan part's): drafts that fail as random weights do.
    big, small = (ensure_mix_model(app_paths().demo_models_dir, s, "Q4_K_M") for s in DRAFT_SHAPES)
    say(progress, f"spec: {big.name} with {small.name} drafting (random weights)")

    options = LoadOptions(
        n_ctx=2048,
        n_threads=physical_cores(),
        kv_type=SPEC_KV,
        speculative="draft",
        draft_model=small,
        step_costs=calibrated_step_costs(app_paths().speed_calibration, big),
    )
    engine = Engine(big, options)
    try:
        ratios, stats, same = _compare(
            engine, PROSE_PROMPT, DRAFT_ROUNDS, DRAFT_TOKENS, "draft model", progress
        )
    finally:
        engine.close()
    return {
        "spec_draft_failing_ratio": round(statistics.median(ratios), 3),
        "spec_draft_failing_drafted": stats.drafted_tokens,
        "spec_draft_failing_identical": same,
    }


# Steps of 1 to 9 tokens: drafts of up to 8, as the policy makes them.
POSSIBLE_STEP_SIZES = tuple(range(1, 10))


def possible_speedup(model_path: Path, context_tokens: int, n_ctx: int = SPEC_CTX) -> float:
    """The most drafting could give on this model here and now: a step of k tokens that gives
    all k (every draft accepted) over k single steps, the best k. The steps are timed bare
    (llama.cpp alone, not the engine's own cost model) on a cache like the part's: its size
    (``n_ctx``) and type, flash attention, ``context_tokens`` in it (the copy reply's mean)."""
    from localchat.backends.llama.engine import KV_TYPES
    from localchat.backends.llama.tools import step_times

    sizes = POSSIBLE_STEP_SIZES
    times = step_times(
        model_path,
        physical_cores(),
        sizes,
        n_ctx=n_ctx,
        context_tokens=context_tokens,
        kv_type=KV_TYPES[SPEC_KV],
        flash_attn=True,
    )
    return max(size * times[0] / took for size, took in zip(sizes, times, strict=True))


def _ceiling(stats: TurnStats, costs: dict[int, float]) -> tuple[float, float]:
    """(tokens per single-step cost the turn's steps allow, the mean draft length): plain
    steps cost one, each verification what a step of the mean draft plus one costs."""
    if not stats.draft_steps:
        return 1.0, 0.0
    mean_draft = stats.drafted_tokens / stats.draft_steps
    low = int(mean_draft)
    share = mean_draft - low
    step_cost = (1 - share) * costs[low + 1] + share * costs.get(low + 2, costs[low + 1])
    plain_steps = max(0, stats.generated_tokens - stats.accepted_tokens - stats.draft_steps)
    return stats.generated_tokens / (plain_steps + stats.draft_steps * step_cost), mean_draft
