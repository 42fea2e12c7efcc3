"""``bench --only embed``: embeddings through the server (``/v1/embeddings`` over HTTP, as
a client reads them) against llama-cpp-python's own ``Llama(embedding=True).embed`` of the
same texts, from ``localchat serve --embedding-model`` in a process of its own: a generated
BERT embedder (no small embedding GGUF ships on the registry) and a generated decoder
mean-pooled (a chat model asked for embeddings). Seconds.

- ``embed_cosine``: the lowest cosine between a server's vector and the reference's, over
  both models and every text (beside it each model's own, and the vectors' largest
  distance from unit length).
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import numpy as np

from localchat.bench.common import Progress, say, scratch_dir

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "a local model answers in the terminal and keeps its cache on disk",
    "memory",
]


def _served_vectors(root: str, model: str) -> list[np.ndarray]:
    """The vectors as the OpenAI client asks for them by default (base64 float32)."""
    from localchat.bench.serve import http_client

    body = {"model": model, "input": TEXTS, "encoding_format": "base64"}
    reply = http_client().post(f"{root}/v1/embeddings", json=body)  # shared: never closed
    if reply.status_code != 200:
        raise RuntimeError(f"{model}: {reply.status_code} {reply.text}")
    rows = sorted(reply.json()["data"], key=lambda d: d["index"])
    return [np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4") for r in rows]


def _cosines(got: list[np.ndarray], expected: list[np.ndarray]) -> list[float]:
    return [
        float(np.dot(g, e) / (np.linalg.norm(g) * np.linalg.norm(e)))
        for g, e in zip(got, expected, strict=True)
    ]


def bench_embed(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The figures on generated models (``model_path`` is not used), through ``localchat
    serve --embedding-model`` in a process of its own."""
    from localchat.backends.llama.embedder import reference_embeddings
    from localchat.bench.serve import ServeProcess
    from localchat.models.demo import make_demo_model
    from localchat.models.demo_bert import make_embedding_model

    results: dict[str, Any] = {}
    worst_norm = 0.0
    with scratch_dir("embed") as scratch:
        bert = make_embedding_model(scratch / "bert.gguf", "bert-minilm")
        chat = make_demo_model(scratch / "chat.gguf", "tiny", "F16")
        extra = ("--embedding-model", str(bert))
        with ServeProcess(chat, scratch / "home", extra=extra, ctx=512) as root:
            for name, model, path in (("bert", bert.stem, bert), ("decoder", chat.stem, chat)):
                start = time.perf_counter()
                served = _served_vectors(root, model)
                results[f"embed_{name}_s"] = round(time.perf_counter() - start, 3)
                cosines = _cosines(served, reference_embeddings(path, TEXTS))
                results[f"embed_cosine_{name}"] = round(min(cosines), 6)
                worst_norm = max([worst_norm, *(abs(float(np.linalg.norm(v)) - 1) for v in served)])
                say(progress, f"embed: {name} cosine {min(cosines):.6f}")
    results["embed_cosine"] = min(results["embed_cosine_bert"], results["embed_cosine_decoder"])
    results["embed_norm_error"] = round(worst_norm, 7)
    results["embed_model"] = "generated BERT (bert-minilm shape), generated llama decoder"
    return results
