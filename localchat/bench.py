"""``localchat bench``: speed and memory figures, measured as ratios within one run.

Timings on a shared machine are noisy, so every target compares two things measured side by
side in the same process (engine vs bare llama-cpp-python, interleaved, medians of rounds).
Tests never assert on these numbers; this command reports them against their targets.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat import __version__
from localchat.hardware import physical_cores

PARTS: tuple[str, ...] = ("engine",)

ENGINE_CTX = 2048
ENGINE_PROMPT_TOKENS = 256
ENGINE_GEN_TOKENS = 128
ENGINE_ROUNDS = 3

# name -> (comparison, threshold)
TARGETS: dict[str, tuple[str, float]] = {
    "gen_ratio": (">=", 0.97),
}

Progress = Callable[[str], None] | None


def _say(progress: Progress, line: str) -> None:
    if progress is not None:
        progress(line)


def bench_engine(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Prompt and generation speed through the engine vs a bare llama-cpp-python loop."""
    from localchat.engine import (
        LLAMA_CPP_VERSION,
        Engine,
        LoadOptions,
        Sampling,
        bare_generation_benchmark,
        synthetic_prompt,
    )

    threads = physical_cores()
    engine = Engine(model_path, LoadOptions(n_ctx=ENGINE_CTX, n_threads=threads))
    prompt = synthetic_prompt(engine.bos_token, engine.n_vocab, ENGINE_PROMPT_TOKENS)
    engine_prompt, engine_gen, bare_prompt, bare_gen = [], [], [], []
    try:
        for round_no in range(1, ENGINE_ROUNDS + 1):
            engine.reset()
            generation = engine.generate(prompt, Sampling(temperature=0.0), ENGINE_GEN_TOKENS)
            for _ in generation:
                pass
            engine_prompt.append(generation.stats.prompt_tps)
            engine_gen.append(generation.stats.gen_tps)
            bare = bare_generation_benchmark(
                model_path, ENGINE_CTX, ENGINE_PROMPT_TOKENS, ENGINE_GEN_TOKENS, threads
            )
            bare_prompt.append(bare["bare_prompt_tps"])
            bare_gen.append(bare["bare_gen_tps"])
            _say(
                progress,
                f"engine round {round_no}/{ENGINE_ROUNDS}: gen {engine_gen[-1]:.1f} tok/s"
                f" (bare {bare_gen[-1]:.1f}), prompt {engine_prompt[-1]:.1f} tok/s"
                f" (bare {bare_prompt[-1]:.1f})",
            )
    finally:
        engine.close()
    gen_tps = statistics.median(engine_gen)
    bare_gen_tps = statistics.median(bare_gen)
    return {
        "llama_cpp_python": LLAMA_CPP_VERSION,
        "prompt_tps": round(statistics.median(engine_prompt), 2),
        "gen_tps": round(gen_tps, 2),
        "bare_prompt_tps": round(statistics.median(bare_prompt), 2),
        "bare_gen_tps": round(bare_gen_tps, 2),
        "gen_ratio": round(gen_tps / bare_gen_tps, 4),
    }


BENCHES: dict[str, Callable[[Path, Progress], dict[str, Any]]] = {
    "engine": bench_engine,
}


def run_bench(
    model_path: Path, parts: tuple[str, ...], progress: Progress = None
) -> dict[str, Any]:
    """Run the named parts on one model; returns one flat JSON-ready object with targets."""
    results: dict[str, Any] = {
        "localchat": __version__,
        "model": str(model_path),
        "machine": f"{platform.machine()}, {physical_cores()} cores",
        "parts": list(parts),
    }
    for part in parts:
        _say(progress, f"running {part}")
        results.update(BENCHES[part](model_path, progress))
    results["targets"] = {
        name: {
            "target": f"{op} {threshold}",
            "value": results[name],
            "met": results[name] >= threshold if op == ">=" else results[name] <= threshold,
        }
        for name, (op, threshold) in TARGETS.items()
        if name in results
    }
    return results


def format_report(results: dict[str, Any]) -> str:
    lines = [f"{key}: {value}" for key, value in results.items() if key != "targets"]
    for name, target in results.get("targets", {}).items():
        verdict = "met" if target["met"] else "MISSED"
        lines.append(f"target {name} {target['target']}: {target['value']} ({verdict})")
    return "\n".join(lines) + "\n"
