"""What the embeddings endpoints ask of whoever holds the models (``EmbeddingModels``): one
blocking call that embeds a batch of inputs with a model named by the request, and answers
a name it does not serve, or an input it cannot take, with an ``ApiError``. The adapter
(``adapters/embeddings.py``) never knows how a model is had: ``serve`` hands it
``library_embeddings.LibraryEmbeddings``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from localchat.backends.llama.embedder import BadEmbeddingInput, Embedder, EmbeddingInputTooLong
from localchat.server.requests import ApiError

EmbedInputs = Sequence[str | Sequence[int]]  # texts, or token-id lists


@dataclass(frozen=True)
class EmbedResult:
    """A batch's vectors (one per input, in order, as the model expects them normalized),
    the name of the model that made them, the tokens read (``usage``, Ollama's
    ``prompt_eval_count``), and the seconds spent loading it for this request (0 when it
    was loaded already) and in all."""

    model: str
    vectors: list[npt.NDArray[np.float32]]
    prompt_tokens: int
    load_s: float = 0.0
    total_s: float = 0.0


class EmbeddingModels(Protocol):
    """Who embeds for the server."""

    def embed(self, model: str | None, inputs: EmbedInputs, truncate: bool = False) -> EmbedResult:
        """Embed ``inputs`` (texts, or token-id lists) with ``model`` (None or "": the
        default embedding model). Blocking (the adapter runs it in a worker thread; the
        model's own work belongs on the compute thread). Raises ``ApiError``: 404 for a
        model it does not serve, 400 for an input it cannot take (one past the model's
        context, naming the limit, unless ``truncate`` cuts it there; an empty one)."""
        ...


def no_model(model: str | None, served: Sequence[str]) -> ApiError:
    """The 404 for a name not served, listing those that are."""
    listed = ", ".join(served) or "none"
    return ApiError(404, f"model {model!r} is not served for embeddings here (served: {listed})",
                    code="model_not_found")  # fmt: skip


def embedded(
    name: str,
    embedder: Embedder,
    inputs: EmbedInputs,
    truncate: bool,
    start: float,
    load_s: float = 0.0,
) -> EmbedResult:
    """``inputs`` embedded by ``embedder`` under ``name``; an input it cannot take is a 400."""
    try:
        found = embedder.embed(inputs, truncate)
    except BadEmbeddingInput as exc:
        too_long = isinstance(exc, EmbeddingInputTooLong)
        code = "context_length_exceeded" if too_long else "invalid_value"
        raise ApiError(400, str(exc), code=code) from None
    total = time.perf_counter() - start
    return EmbedResult(name, found.vectors, found.total_tokens, load_s, total)
