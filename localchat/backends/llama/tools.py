"""llama.cpp outside a chat: quantizing a file, what the build supports, the bare loop the
bench and the calibration measure, and llama-cpp-python's own server for tests and bench."""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

from localchat.backends.llama.internals import (
    decode_filled_batch,
    drop_cells_from,
    fill_batch_every_position,
)
from localchat.backends.llama.runtime import last_error_line, prepare
from localchat.errors import ModelLoadError, UsageError

QUANT_FTYPES: dict[str, int] = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "IQ4_XS": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
}


def quantize_model(source: Path, dest: Path, quant: str, threads: int = 0) -> None:
    """Quantize ``source`` (F16/F32 GGUF) into ``dest`` with llama.cpp's own quantizer."""
    prepare()
    if quant not in QUANT_FTYPES:
        raise UsageError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[quant]
    params.nthread = threads
    result = llama_cpp.llama_model_quantize(
        str(source).encode("utf-8"), str(dest).encode("utf-8"), ctypes.byref(params)
    )
    if result != 0:
        raise ModelLoadError(
            f"{source}: llama.cpp could not quantize it to {quant} ({last_error_line()})"
        )


def supports_gpu_offload() -> bool:
    """Whether this llama.cpp build was compiled with a GPU backend."""
    return bool(llama_cpp.llama_supports_gpu_offload())


def _bare_llama(model_path: Path, n_ctx: int, threads: int, **options: Any) -> llama_cpp.Llama:
    """llama-cpp-python's ``Llama`` as a bare loop loads it: no localchat code in its way."""
    prepare()
    return llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=n_ctx,
        n_batch=min(512, n_ctx),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **options,
    )


class BareLoop:
    """A bare llama-cpp-python model, no localchat code in it: the yardstick for the engine.
    Kept loaded between rounds as the engine is, so a comparison of the two measures their
    loops, not one side's load (its page faults and fresh buffers, which this host charges
    unevenly)."""

    def __init__(self, model_path: Path, n_ctx: int, threads: int) -> None:
        self.threads = threads
        self.llm = _bare_llama(model_path, n_ctx, threads)

    def __enter__(self) -> BareLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.llm.close()

    def run(
        self,
        prompt_tokens: int,
        gen_tokens: int,
        step_sizes: tuple[int, ...] = (),
        cold: bool = True,
        step_repeats: int = 1,
    ) -> dict[str, Any]:
        """A prompt of ``prompt_tokens`` (read from an empty cache unless ``cold`` is False),
        then ``gen_tokens`` greedy tokens. ``step_sizes``: then also the time of a step of each of these many tokens
        with every position's logits (``step_s``), after the generated ones. ``cold=False``:
        the prompt as the last run left it cached (llama-cpp-python keeps the longest prefix
        and evaluates the last token again), so only generation is timed afresh."""
        llm = self.llm
        if cold:
            llm.reset()  # an empty cache: every round reads the same prompt
        prompt = synthetic_prompt(llm.token_bos(), int(llm.n_vocab()), prompt_tokens)
        generated = 0
        start = time.perf_counter()
        cpu_start = time.process_time()  # every thread of the process
        first_at = last_at = start
        for _token in llm.generate(prompt, temp=0.0):
            last_at = time.perf_counter()
            if generated == 0:
                first_at = last_at
            generated += 1
            if generated >= gen_tokens:
                break
        cpu_s = time.process_time() - cpu_start
        steps = _time_steps(llm, prompt, step_sizes, step_repeats) if step_sizes else []
        return {
            "step_s": steps,
            "bare_prompt_tps": prompt_tokens / (first_at - start),
            "bare_gen_tps": (generated - 1) / max(1e-9, last_at - first_at),
            # The CPU its threads got against what they could have had: low when another
            # program competed for the cores (calibration throws such readings away).
            "cpu_share": cpu_s / max(1e-9, (last_at - start) * self.threads),
        }


def bare_generation_benchmark(
    model_path: Path,
    n_ctx: int,
    prompt_tokens: int,
    gen_tokens: int,
    threads: int,
    step_sizes: tuple[int, ...] = (),
    step_repeats: int = 1,
) -> dict[str, Any]:
    """One ``BareLoop`` round on a model loaded for it (calibration reads each file once)."""
    with BareLoop(model_path, n_ctx, threads) as bare:
        return bare.run(prompt_tokens, gen_tokens, step_sizes, step_repeats=step_repeats)


def step_times(
    model_path: Path,
    threads: int,
    sizes: tuple[int, ...],
    repeats: int = 6,
    *,
    n_ctx: int = 256,
    context_tokens: int = 64,
    kv_type: int = llama_cpp.GGML_TYPE_F16,
    flash_attn: bool = False,
) -> list[float]:
    """Seconds a step of each of ``sizes`` tokens takes with every position's logits (a
    draft's verification): the best of ``repeats``, the sizes taken in turns after a prompt
    of ``context_tokens`` so every size sees the same cache and the same spell of the machine.
    (A step's attention grows with the context and does not share its work between a
    batch's tokens as the weights do: the cache's size, type and fill change the curve.)"""
    # Each step reuses the prompt's tokens after the first, and the steps go after it.
    if not max(sizes) < context_tokens <= n_ctx - max(sizes):
        raise ValueError(
            f"steps of up to {max(sizes)} tokens need a context of {max(sizes) + 1}"
            f"-{n_ctx - max(sizes)} tokens in a cache of {n_ctx}; got {context_tokens}"
        )
    llm = _bare_llama(
        model_path, n_ctx, threads, type_k=kv_type, type_v=kv_type, flash_attn=flash_attn
    )
    try:
        prompt = synthetic_prompt(llm.token_bos(), int(llm.n_vocab()), context_tokens)
        llm.eval(prompt)
        return _time_steps(llm, prompt, sizes, repeats)
    finally:
        llm.close()


def _time_steps(
    llm: llama_cpp.Llama, tokens: list[int], sizes: tuple[int, ...], repeats: int
) -> list[float]:
    """The best of ``repeats`` timings of a step of each of ``sizes`` of ``tokens`` at the
    end of what ``llm`` holds, taken in turns (each size sees the same cache and spell)."""
    n_past = llm.n_tokens
    best = [float("inf")] * len(sizes)
    for _ in range(repeats):
        for index, n_tokens in enumerate(sizes):
            drop_cells_from(llm, n_past)
            fill_batch_every_position(llm, tokens[1 : 1 + n_tokens], n_past)
            started = time.perf_counter()
            decode_filled_batch(llm)
            best[index] = min(best[index], time.perf_counter() - started)
    drop_cells_from(llm, n_past)
    return best


def synthetic_prompt(bos: int, n_vocab: int, length: int) -> list[int]:
    """A fixed, reproducible prompt of ``length`` ordinary tokens (ids past the specials)."""
    first_normal = 300
    return [bos] + [first_normal + (i * 7919) % (n_vocab - first_normal) for i in range(length - 1)]


def llama_server_command() -> list[str]:
    """llama-cpp-python's own OpenAI-compatible server (tests and bench serve with it),
    started through this module so the extra-buffer guard applies in it too."""
    start = "import runpy, localchat.backends.llama.runtime as r; r.prepare(); runpy.run_module('llama_cpp.server', run_name='__main__')"
    return [sys.executable, "-c", start]
