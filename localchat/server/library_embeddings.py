"""Embeddings when ``serve`` serves the library: its embedding models (GGUFs with a pooling
type; the first is the default) and any chat model the router serves, mean-pooled, each
loaded at its first request beside the chat models and kept for the server's life (an
embedding model is small: tens to hundreds of MB; a chat model asked for embeddings is a
second copy of its weights, outside the router's count)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from localchat.backends.llama.embedder import Embedder
from localchat.errors import LocalchatError, one_line
from localchat.server.embeddings import EmbedInputs, EmbedResult, embedded, no_model
from localchat.server.requests import ApiError
from localchat.server.router import Router, ServedEntry


class LibraryEmbeddings:
    """An ``EmbeddingModels`` over ``embedding`` models and the ``chat`` router's models."""

    def __init__(self, embedding: list[ServedEntry], chat: Router | None = None) -> None:
        self.embedding = embedding
        self.chat = chat
        self._loaded: dict[Path, Embedder] = {}
        self._lock = threading.Lock()

    def _entry(self, model: str | None) -> ServedEntry:
        """The embedding model asked for (none named: the first), else a chat model served
        under that name, mean-pooled; a 404 naming what is served."""
        chat = self.chat.entries if self.chat is not None else []
        for entry in (*self.embedding, *chat):
            names = entry.answers_to
            if not model and entry in self.embedding:
                return entry
            if model and (model in names or model.removesuffix(":latest") in names):
                return entry
        if not model:
            raise ApiError(404, "no embedding model is served here: add one (`localchat pull"
                           " nomic-embed-text-v1.5`), start serve with --embedding-model, or"
                           " name a chat model to have it mean-pooled", code="model_not_found")  # fmt: skip
        raise no_model(model, [e.name for e in (*self.embedding, *chat)])

    def _embedder(self, entry: ServedEntry) -> tuple[Embedder, float]:
        with self._lock:
            found = self._loaded.get(entry.path)
            if found is not None:
                return found, 0.0
            start = time.perf_counter()
            try:
                embedder = Embedder(entry.path)
            except (LocalchatError, OSError, ValueError, RuntimeError) as exc:
                raise ApiError(500, f"{entry.path} failed to load for embeddings:"
                               f" {one_line(exc)}", "server_error", "model_load_failed") from None  # fmt: skip
            self._loaded[entry.path] = embedder
            return embedder, time.perf_counter() - start

    def embed(self, model: str | None, inputs: EmbedInputs, truncate: bool = False) -> EmbedResult:
        start = time.perf_counter()
        entry = self._entry(model)
        embedder, load_s = self._embedder(entry)
        return embedded(model or entry.name, embedder, inputs, truncate, start, load_s)

    def close(self) -> None:
        with self._lock:
            for embedder in self._loaded.values():
                embedder.close()
            self._loaded.clear()
