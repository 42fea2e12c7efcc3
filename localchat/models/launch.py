"""The launch options: how the user asked a model to run, as one frozen object carried
from the command line to the load (vLLM's ``EngineArgs`` is the model). A light module: the
command line builds these before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchOptions:
    """How the user asked a model to run, carried whole from the command line to the load.

    ``None`` is "not given": ``Settings.launch`` fills those from settings.toml, and the
    load from the model (its trained context, its template)."""

    n_ctx: int | None = None
    n_threads: int | None = None
    template: str | None = None  # a built-in format name or a .jinja file
    kv_type: str | None = None
    swa_cache: str | None = None
    speculative: str | None = None
    draft_model: str | None = None  # a catalog name or a .gguf file
    # The flag named the draft model: it must draft (the setting's or the catalog's is left
    # out, said in one line, for a model of another family).
    draft_required: bool = False
    # ``serve``: drafts by prompt lookup only (never a draft model), and the engine's own
    # context is this many cells where the sequences' contexts hold the KV.
    lookup_only: bool = False
    own_cells: int | None = None
    # The attention kernel and micro-batch a plan chose for the memory left (None: the
    # engine's rule; ``serve``'s router plans each model as ``hw`` would).
    flash_attn: bool | None = None
    n_ubatch: int | None = None
    # The vision projector: a file, "none" (no images), or None (the one beside the model).
    projector: str | None = None
