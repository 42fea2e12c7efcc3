"""``bench --only memory``: a turn that fills a long context, in a fresh process: its peak
resident memory against the interpreter's baseline plus llama.cpp's own buffers (nothing
unaccounted for: ``memory_overhead_ratio``), and the estimate against the growth.

The rows were a 0.5b and a Gemma 3 shape at 32k, which took most of a 47-minute bench:
filling a context costs time quadratic in its length (attention over every cached token),
32k tokens of the 0.5b shape over 15 minutes on two cores. The figures need a full context with
flash attention's buffers in it, as llama.cpp's CPU runs take it for long contexts: the Gemma
3 shape at 8k (``FLASH_ATTN_CPU_MIN_CTX``, where the engine turns it on; 16 times its window,
whose layers' cache must stay window-sized) and the 0.5b shape at 4k with it turned on
(filling 8k of the 0.5b took a 2-core host 150 s, 4k 40 s; without flash attention, at 2k,
its peak held 40 MiB that llama.cpp's reported buffers do not, which the estimate counts).
What grows with the context (the KV cache, flash attention's work buffers,
llama-cpp-python's arrays) is sized by ``n_ctx`` and shows here as it would at 32k. (A
smaller plain shape fills in seconds, but its buffers are so small that the runtime's fixed
~10 MiB - library code paged in, the vocabulary - read as 9% unaccounted.) The models are
the quantizer's type mix in random blocks (``models/timing_models.py``): memory depends on
the bytes, not the values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, say
from localchat.bench.rss import measure_in_fresh_process

# (shape, quant, context): a plain shape and a sliding-window one, each context filled,
# with flash attention.
MEMORY_MODELS: tuple[tuple[str, str, int], ...] = (
    ("0.5b", "Q4_K_M", 4096),
    ("gemma3", "Q8_0", 8192),
)
MEMORY_GEN_TOKENS = 16


def bench_memory(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Peak RSS of a real turn at a full long context against llama.cpp's own buffers plus
    the interpreter's baseline, and the estimate against the growth (each in a new process)."""
    from localchat.gguf.estimate import LayerWeights, ModelDims, estimate_memory
    from localchat.gguf.info import read_gguf
    from localchat.models.hardware import repacked_weight_types
    from localchat.models.timing_models import ensure_mix_model
    from localchat.paths import app_paths

    rows: dict[str, dict[str, Any]] = {}
    for shape, quant, n_ctx in MEMORY_MODELS:
        say(progress, f"memory: {shape} {quant}, a full context of {n_ctx} tokens")
        path = ensure_mix_model(app_paths().demo_models_dir, shape, quant)
        info = read_gguf(path)
        weights = LayerWeights.from_gguf(info, repacked_weight_types())
        estimate = estimate_memory(ModelDims.from_gguf(info), weights, n_ctx, flash_attn=True)
        measured = measure_in_fresh_process(path, n_ctx, MEMORY_GEN_TOKENS, flash_attn=True)
        reported = sum(
            measured[k] for k in ("weights_bytes", "kv_bytes", "compute_bytes", "output_bytes")
        )
        ratio = measured["rss_peak"] / (measured["rss_before"] + reported)
        error = (estimate.total - measured["rss_growth"]) / measured["rss_growth"]
        rows[f"{shape} {quant} ctx {n_ctx}"] = {
            **measured,
            "llama_cpp_reported_bytes": reported,
            "overhead_ratio": round(ratio, 4),
            "estimated_bytes": estimate.total,
            "estimate_error": round(error, 4),
        }
        say(progress, f"memory: {shape}: peak {measured['rss_peak'] / 2**20:.0f} MiB,"
             f" baseline + llama.cpp's buffers {(measured['rss_before'] + reported) / 2**20:.0f}"
             f" MiB (x{ratio:.3f}); estimate {error:+.1%}")  # fmt: skip
    return {
        "memory_models": rows,
        "memory_overhead_ratio": max(r["overhead_ratio"] for r in rows.values()),
        "memory_estimate_max_error": max(abs(r["estimate_error"]) for r in rows.values()),
    }
