"""What clients read about the served model before they send anything — its context,
size, quantization, template and capabilities — gathered once, for every API's listing
(``/v1/models``, llama-server's ``/props``, Ollama's ``/api/tags``, ``/api/show``,
``/api/ps``)."""

from __future__ import annotations

from dataclasses import dataclass

from localchat.chat.reasoning import OPEN
from localchat.server.runner import ModelRunner


@dataclass(frozen=True)
class ServedModel:
    """The model behind the server, as its listings describe it."""

    name: str
    names: tuple[str, ...]  # the name and its aliases, each listed
    architecture: str
    parameters: int
    size_bytes: int
    quantization: str  # the file's type: Q4_K_M, Q8_0, F16, …
    n_ctx: int  # what one request may hold (a sequence's context)
    n_ctx_train: int
    n_vocab: int
    slots: int
    template: str  # the chat template's source
    capabilities: tuple[str, ...]  # Ollama's words: completion, tools, thinking
    digest: str  # the file's fingerprint (sampled, not a hash of every byte)
    modified_at: float  # the file's mtime

    @property
    def parameter_label(self) -> str:
        """Ollama's way of saying the size: "135M", "1.5B"."""
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if self.parameters >= scale:
                return f"{self.parameters / scale:.3g}{unit}"
        return str(self.parameters)


def served_model(runner: ModelRunner) -> ServedModel:
    engine = runner.engine
    info = engine.info
    source = engine.template.source
    capabilities = ["completion"]
    if "tools" in source:
        capabilities.append("tools")
    if OPEN in source:
        capabilities.append("thinking")
    path = engine.model_path
    return ServedModel(
        name=runner.model_name,
        names=runner.names,
        architecture=info.architecture,
        parameters=info.parameter_count,
        size_bytes=path.stat().st_size,
        quantization=info.file_type,
        n_ctx=runner.batch.n_ctx_seq,
        n_ctx_train=info.context_length,
        n_vocab=engine.n_vocab,
        slots=runner.batch.n_seq,
        template=source,
        capabilities=tuple(capabilities),
        digest=engine.fingerprint,
        modified_at=path.stat().st_mtime,
    )
