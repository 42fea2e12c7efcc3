"""How the engine's context is made, decided from the load options and the file before
llama.cpp loads anything: the context size, threads, the KV cache's type, the attention
kernel, and whether replies draft. A wrong option is a ``UsageError`` before any load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from localchat.backends.base import SPECULATIVE_MODES
from localchat.backends.llama.image_positions import ImageSource
from localchat.cpu import physical_cores
from localchat.errors import UsageError
from localchat.gguf.estimate import preferred_flash_attn
from localchat.gguf.info import GGUFInfo
from localchat.gguf.quants import SWA_CACHE_MODES

KV_TYPES: dict[str, int] = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}

MIN_CTX = 32
# The context used when none is asked for (capped at the model's trained context).
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model: context size, threads, GPU layers, the KV cache type, and the
    chat template (``None``: the model's own, else one chosen from what the file says)."""

    n_ctx: int | None = None  # None: DEFAULT_CTX, capped at the model's trained context
    n_threads: int | None = None
    n_gpu_layers: int = 0
    kv_type: str = "f16"
    n_batch: int = 512
    template: str | None = None  # a built-in format name or a .jinja file
    swa_cache: str = "window"  # sliding-window layers: "window" (their window) or "full"
    flash_attn: bool | None = None  # None: where it costs nothing (``preferred_flash_attn``)
    n_ubatch: int = 512  # the micro-batch: the compute buffer grows with it
    # Speculative decoding (drafting.py): "auto" drafts by prompt lookup and with the draft
    # model, if one is given, where a batch's logits equal single steps'
    # (``Engine.batch_invariant``), so replies stay exactly the same; "ngram" (prompt
    # lookup) and "draft" (the draft model) draft anyway, accepting llama.cpp's batch
    # rounding; "off" never.
    speculative: str = "auto"
    draft_model: Path | None = None  # a smaller model of the same family (draft_model.py)
    # False: a draft model that cannot draft for this one (another vocabulary, a file
    # llama.cpp refuses) is left out with the reason in ``draft_model_unused``, not an error.
    draft_required: bool = True
    # This machine's calibration, where there is one: what a step of n tokens costs this
    # model (in single steps, by n: ``SpeedModel.step_costs``) and a draft model's step
    # against the model's; the drafting policy starts from these until it has timed steps
    # of its own.
    step_costs: dict[int, float] | None = None
    draft_step_cost: float | None = None
    # Where another context on these weights does the work (serve's sequences): the cells
    # of the engine's own, which then only warms the model up. The plan (flash attention,
    # ``planned_ctx``) is still made for ``n_ctx``.
    own_cells: int | None = None
    # Images (``image_reader``): the projector (mmproj GGUF) to read them with, where they
    # are kept by key (the data folder's store: their placeholder ids must hold across
    # processes), and where their encoded embeddings are kept on disk (None: memory only).
    projector: Path | None = None
    images: ImageSource | None = None
    embeddings_dir: Path | None = None


@dataclass(frozen=True)
class ContextPlan:
    """What ``plan_context`` decided for a load."""

    n_ctx: int  # the context the plan is for (``LoadOptions.own_cells`` aside)
    own_cells: int  # the cells of the engine's own context
    threads: int  # how many threads generate
    kv_type_id: int  # llama.cpp's ggml type of the K and V caches
    flash_attn: bool
    # Whether a batch's logits equal single steps' here, so drafts change no reply.
    batch_invariant: bool
    # Whether generations draft (a recurrent model, known once loaded, never does).
    drafting: bool


def plan_context(options: LoadOptions, info: GGUFInfo, model_path: Path) -> ContextPlan:
    """The context ``options`` ask for on the model ``info`` describes; a ``UsageError``
    names the first option that cannot be (in the order the options are listed)."""
    if options.kv_type not in KV_TYPES:
        raise UsageError(
            f"unknown KV cache type {options.kv_type!r}; choose one of {', '.join(KV_TYPES)}"
        )
    n_ctx = _context_size(options, info, model_path)
    _check_modes(options)
    # Quantized V caches need flash attention in llama.cpp; elsewhere the plan's rule.
    flash_attn = options.kv_type != "f16" or (
        options.flash_attn
        if options.flash_attn is not None
        else preferred_flash_attn(n_ctx, options.kv_type, options.n_gpu_layers > 0)
    )
    # Drafts verified in batches change nothing where the kernels give a batch the
    # logits single steps would. On llama.cpp's CPU backend that holds with flash
    # attention over a quantized KV cache (one kernel for any batch: measured
    # bit-identical at 700 cached tokens). With an F16 cache a single token past 512
    # cells takes a split-KV path of its own, and without flash attention the KQ
    # products differ by batch size: a logit moves by up to ~1.2, enough to flip a
    # greedy pick. GPU kernels also differ by batch size (not measured here).
    batch_invariant = flash_attn and options.kv_type != "f16" and not options.n_gpu_layers
    mode = options.speculative
    return ContextPlan(
        n_ctx=n_ctx,
        own_cells=min(options.own_cells or n_ctx, n_ctx),
        threads=options.n_threads or physical_cores(),
        kv_type_id=KV_TYPES[options.kv_type],
        flash_attn=flash_attn,
        batch_invariant=batch_invariant,
        drafting=mode in ("ngram", "draft") or (mode == "auto" and batch_invariant),
    )


def _context_size(options: LoadOptions, info: GGUFInfo, model_path: Path) -> int:
    """The context asked for, else ``DEFAULT_CTX`` capped at the model's trained context."""
    trained = info.context_length
    n_ctx = options.n_ctx or (min(DEFAULT_CTX, trained) if trained else DEFAULT_CTX)
    if n_ctx < MIN_CTX:
        raise UsageError(f"context size {n_ctx} is too small; use at least {MIN_CTX}")
    if trained and n_ctx > trained:
        raise UsageError(
            f"{model_path}: context size {n_ctx} is larger than the model's trained"
            f" context {trained}; use --ctx {trained} or less"
        )
    return n_ctx


def _check_modes(options: LoadOptions) -> None:
    """The speculative mode (and the draft model it needs) and the window cache's mode."""
    if options.speculative not in SPECULATIVE_MODES:
        raise UsageError(
            f"unknown speculative mode {options.speculative!r}; choose one of"
            f" {', '.join(SPECULATIVE_MODES)}"
        )
    if options.speculative == "draft" and options.draft_model is None:
        raise UsageError(
            "speculative mode 'draft' needs a draft model: give --draft-model NAME|FILE"
            " (a smaller model of the same family)"
        )
    if options.swa_cache not in SWA_CACHE_MODES:
        raise UsageError(
            f"unknown swa_cache {options.swa_cache!r}; choose one of {', '.join(SWA_CACHE_MODES)}"
        )
