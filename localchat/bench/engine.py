"""``bench --only engine``: prompt and generation speed through the engine against a bare
llama-cpp-python loop on the same model, interleaved so the machine's drift cancels out."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, _say, greedy_turn, settled
from localchat.cpu import physical_cores

ENGINE_CTX = 2048
ENGINE_PROMPT_TOKENS = 256
ENGINE_GEN_TOKENS = 128
# Rounds sized by noise: five, then up to seven until the last three rounds' ratios agree
# within ENGINE_AGREE. One round's ratio swings by +-6% here, so the median of three or five
# landed anywhere in 0.95-1.03 for two loops that run at parity.
ENGINE_MIN_ROUNDS = 5
ENGINE_ROUNDS = 7
ENGINE_AGREE = 0.03


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
        stats = greedy_turn(engine, prompt, ENGINE_GEN_TOKENS)
        engine_prompt.append(stats.prompt_tps)
        engine_gen.append(stats.gen_tps)

    def bare_round() -> None:
        figures = bare.run(ENGINE_PROMPT_TOKENS, ENGINE_GEN_TOKENS)
        bare_prompt.append(figures["bare_prompt_tps"])
        bare_gen.append(figures["bare_gen_tps"])

    try:
        for round_no in range(1, ENGINE_ROUNDS + 1):
            if round_no > ENGINE_MIN_ROUNDS and settled(ratios, ENGINE_AGREE, ENGINE_MIN_ROUNDS):
                break
            # Alternate who goes first, and compare within each round, so drift in the
            # machine's speed during the run cancels out.
            for run in (engine_round, bare_round) if round_no % 2 else (bare_round, engine_round):
                run()
            ratios.append(engine_gen[-1] / bare_gen[-1])
            _say(
                progress,
                f"engine round {round_no}/{ENGINE_ROUNDS}: gen {engine_gen[-1]:.1f} tok/s"
                f" (bare {bare_gen[-1]:.1f}), prompt {engine_prompt[-1]:.1f} tok/s"
                f" (bare {bare_prompt[-1]:.1f})",
            )
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
        "engine_rounds": len(ratios),
    }
