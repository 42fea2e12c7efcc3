"""``bench --only engine``: prompt and generation speed through the engine against a bare
llama-cpp-python loop on the same model, interleaved so the machine's drift cancels out."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, greedy_turn, say
from localchat.cpu import physical_cores

ENGINE_CTX = 2048
ENGINE_PROMPT_TOKENS = 256
ENGINE_PROMPT_ROUNDS = 3  # the prompt read from an empty cache: ~2 s a side
# Generation in many short pairs from the cached prompt, the order alternating: this host's
# speed moves by 10-15% from one second to the next, so two 128-token turns ~5 s apart (a
# prompt read between them) swung +-6-10% a pair, and the median of seven missed 0.97 for
# two loops at parity (0.96 in a noisy hour). Pairs of 40 tokens sit a second apart.
ENGINE_GEN_TOKENS = 40
ENGINE_GEN_PAIRS = 21


def bench_engine(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Prompt and generation speed through the engine vs a bare llama-cpp-python loop."""
    from localchat.backends.llama.engine import LLAMA_CPP_VERSION, Engine, LoadOptions
    from localchat.backends.llama.tools import BareLoop, synthetic_prompt

    threads = physical_cores()
    engine = Engine(model_path, LoadOptions(n_ctx=ENGINE_CTX, n_threads=threads))
    bare = BareLoop(model_path, ENGINE_CTX, threads)  # loaded once, as the engine is
    prompt = synthetic_prompt(engine.bos_token, engine.n_vocab, ENGINE_PROMPT_TOKENS)
    engine_prompt: list[float] = []
    engine_gen: list[float] = []
    bare_prompt: list[float] = []
    bare_gen: list[float] = []
    ratios: list[float] = []

    def engine_round() -> None:
        engine_prompt.append(greedy_turn(engine, prompt, 1).prompt_tps)

    def bare_round() -> None:
        bare_prompt.append(bare.run(ENGINE_PROMPT_TOKENS, 1)["bare_prompt_tps"])

    def engine_gen_round() -> None:
        engine_gen.append(greedy_turn(engine, prompt, ENGINE_GEN_TOKENS, cold=False).gen_tps)

    def bare_gen_round() -> None:
        bare_gen.append(
            bare.run(ENGINE_PROMPT_TOKENS, ENGINE_GEN_TOKENS, cold=False)["bare_gen_tps"]
        )

    try:
        for round_no in range(ENGINE_PROMPT_ROUNDS):  # the prompt from an empty cache
            for run in (engine_round, bare_round) if round_no % 2 else (bare_round, engine_round):
                run()
            say(progress, f"engine: prompt round {round_no + 1}: {engine_prompt[-1]:.1f} tok/s"
                 f" (bare {bare_prompt[-1]:.1f})")  # fmt: skip
        # ...which stays cached: each pair generates after it, so both sides read as long a
        # context and compute the same positions.
        for pair in range(ENGINE_GEN_PAIRS):
            for run in (
                (engine_gen_round, bare_gen_round)
                if pair % 2
                else (bare_gen_round, engine_gen_round)
            ):
                run()
            ratios.append(engine_gen[-1] / bare_gen[-1])
        say(progress, f"engine: generation, {ENGINE_GEN_PAIRS} pairs: the median ratio"
             f" {statistics.median(ratios):.3f}")  # fmt: skip
    finally:
        bare.close()
        engine.close()
    return {
        "llama_cpp_python": LLAMA_CPP_VERSION,
        "prompt_tps": round(statistics.median(engine_prompt), 2),
        "gen_tps": round(statistics.median(engine_gen), 2),
        "bare_prompt_tps": round(statistics.median(bare_prompt), 2),
        "bare_gen_tps": round(statistics.median(bare_gen), 2),
        "gen_ratio": round(statistics.median(ratios), 4),
        "engine_gen_pairs": len(ratios),
    }
