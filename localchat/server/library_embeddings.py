"""Embeddings when ``serve`` serves the library: its embedding models (GGUFs with a pooling
type; the first is the default) and any chat model the router serves, mean-pooled, each
loaded at its first request beside the chat models and kept for the server's life (an
embedding model is small: tens to hundreds of MB)."""

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
        for entry in self.embedding:
            names = entry.answers_to
            if not model or model in names or model.removesuffix(":latest") in names:
                return entry
        if model and self.chat is not None:
            try:
                return self.chat.entry_of(model)
            except ApiError:
                pass
        served = [e.name for e in self.embedding]
        served += [e.name for e in self.chat.entries] if self.chat is not None else []
        raise no_model(model, served)

    def _embedder(self, entry: ServedEntry) -> tuple[Embedder, float]:
        with self._lock:
            found = self._loaded.get(entry.path)
            if found is not None:
                return found, 0.0
            start = time.perf_counter()
            try:
                embedder = Embedder(entry.path)
            except (LocalchatError, OSError, ValueError) as exc:
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
