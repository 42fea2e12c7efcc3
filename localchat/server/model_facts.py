"""What clients read about the served models before they send anything — context, size,
quantization, template and capabilities — for every API's listing (``/v1/models``,
llama-server's ``/props`` and ``/models``, Ollama's ``/api/tags``, ``/api/show``,
``/api/ps``). A loaded model is described by its engine; one not loaded by its file's
header (read once)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from localchat.chat.reasoning import OPEN
from localchat.errors import LocalchatError
from localchat.gguf.info import file_fingerprint, read_gguf
from localchat.models.projectors import find_projector
from localchat.server.requests import ApiError
from localchat.server.router import ModelStatus, Router


@dataclass(frozen=True)
class ServedModel:
    """A model the server serves, as its listings describe it."""

    name: str
    names: tuple[str, ...]  # the name and its aliases, each listed
    architecture: str
    parameters: int
    size_bytes: int
    quantization: str  # the file's type: Q4_K_M, Q8_0, F16, …
    n_ctx: int  # what one request may hold (a sequence's context; not loaded: trained)
    n_ctx_train: int
    n_vocab: int
    slots: int  # sequences answered side by side (0: not loaded)
    template: str  # the chat template's source
    capabilities: tuple[str, ...]  # Ollama's words: completion, tools, thinking, vision
    digest: str  # the file's fingerprint (sampled, not a hash of every byte)
    modified_at: float  # the file's mtime
    path: Path
    status: str = "loaded"  # "loaded", "loading" or "unloaded"
    expires_in_s: float | None = None  # until keep_alive unloads it (None: never)
    memory_bytes: int = 0  # loaded: its weights and its sequences' caches

    @property
    def parameter_label(self) -> str:
        """Ollama's way of saying the size: "135M", "1.5B"."""
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if self.parameters >= scale:
                return f"{self.parameters / scale:.3g}{unit}"
        return str(self.parameters)


def _capabilities(template: str, vision: bool) -> tuple[str, ...]:
    capabilities = ["completion"]
    if "tools" in template:
        capabilities.append("tools")
    if OPEN in template:
        capabilities.append("thinking")
    if vision:
        capabilities.append("vision")
    return tuple(capabilities)


@functools.lru_cache(maxsize=256)
def _has_projector(path: Path, mtime: float) -> bool:
    """Whether a projector that fits the model lies beside it (what a load would use)."""
    try:
        return find_projector(path) is not None
    except (LocalchatError, OSError):
        return False


@functools.lru_cache(maxsize=256)
def _file_facts(path: Path, mtime: float) -> tuple[str, int, str, int, int, str, str]:
    """A model file's facts from its header: (architecture, parameters, quantization,
    trained context, vocabulary, template, fingerprint); read once per file version."""
    info = read_gguf(path)
    template = info.chat_template or ""
    return (info.architecture, info.parameter_count, info.file_type, info.context_length,
            info.n_vocab, template, file_fingerprint(path))  # fmt: skip


def described(status: ModelStatus) -> ServedModel:
    """One model of ``Router.statuses()`` as the listings describe it."""
    entry, runner = status.entry, status.runner
    stat = entry.path.stat()
    if runner is not None:
        engine, info = runner.engine, runner.engine.info
        arch, params, quant = info.architecture, info.parameter_count, info.file_type
        # The header's vocabulary: never a call into a model an unload may be freeing.
        n_ctx, trained, vocab = runner.batch.n_ctx_seq, info.context_length, info.n_vocab
        slots, template, digest = runner.batch.n_seq, engine.template.source, engine.fingerprint
        vision = engine.image_reader is not None
    else:
        arch, params, quant, trained, vocab, template, digest = _file_facts(
            entry.path, stat.st_mtime
        )
        n_ctx, slots = trained, 0
        vision = _has_projector(entry.path, stat.st_mtime)
    return ServedModel(
        name=entry.name, names=entry.names, architecture=arch, parameters=params,
        size_bytes=stat.st_size, quantization=quant, n_ctx=n_ctx, n_ctx_train=trained,
        n_vocab=vocab, slots=slots, template=template, capabilities=_capabilities(template, vision),
        digest=digest, modified_at=stat.st_mtime, path=entry.path, status=status.state,
        expires_in_s=status.expires_in_s,
        memory_bytes=runner.memory_bytes if runner is not None else 0,
    )  # fmt: skip


def served_models(router: Router) -> list[ServedModel]:
    """Every model the router serves, with its status (blocking: headers are read once;
    a file gone or unreadable since the start is left out, never the whole listing)."""
    served = []
    for status in router.statuses():
        try:
            served.append(described(status))
        except (LocalchatError, OSError):
            continue
    return served


def served_model(router: Router, name: str | None = None) -> ServedModel:
    """The model ``name`` asks for (the default where none), as the listings describe it
    (``ApiError`` 404 for an unknown name)."""
    entry = router.entry_of(name)
    found = next((m for m in served_models(router) if m.name == entry.name), None)
    if found is None:
        raise ApiError(500, f"{entry.path} cannot be read: its file is gone or broken",
                       "server_error", "model_unreadable")  # fmt: skip
    return found
