"""Embeddings in each API's shape, over whoever holds the models (``EmbeddingModels``):
OpenAI's ``/v1/embeddings`` (one input or a list, texts or token ids, float or base64,
``usage``), Ollama's ``/api/embed`` (``input``, ``truncate``, ``embeddings`` with its
durations) and its older ``/api/embeddings`` (``prompt`` → ``embedding``). A field this
server cannot honour (``dimensions``: a vector is never cut here) is refused, never
dropped; errors come back in each API's shape (the app picks it by path)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localchat.server.embeddings import EmbeddingModels, EmbedInputs, EmbedResult
from localchat.server.requests import ApiError, bad, flag, only_known, text_field
from localchat.server.wire import Endpoint, nanoseconds, read_json

OPENAI_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
OLLAMA_EMBED_FIELDS = frozenset(
    {"model", "input", "truncate", "options", "keep_alive", "dimensions"}
)
OLLAMA_EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive"})
NOT_SERVED = "this server serves no embedding model: start it with --embedding-model PATH_OR_NAME"


def _no_dimensions(body: dict[str, Any]) -> None:
    if body.get("dimensions") is not None:
        raise bad("dimensions: not supported here (vectors keep the model's own"
                  " length; leave the field out)", "unsupported_parameter")  # fmt: skip


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def openai_inputs(value: Any) -> EmbedInputs:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids, or a list of
    such lists; never empty."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if _is_ids(value):
            return [list(value)]
        if all(_is_ids(v) for v in value):
            return [list(v) for v in value]
    raise bad("input must be a string, a list of strings, a list of token ids or a list of"
              " such lists, and not empty", "invalid_type")  # fmt: skip


def ollama_inputs(value: Any) -> list[str]:
    """Ollama's ``input``: a string or a list of strings, not empty."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise bad("input must be a string or a non-empty list of strings", "invalid_type")


def encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes
    (what the ``openai`` client asks for by default and decodes)."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def openai_body(result: EmbedResult, encoding: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": encoded(v, encoding)}
        for i, v in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": result.model, "usage": usage}


def routes(models: EmbeddingModels | None) -> list[Endpoint]:
    """The three endpoints over ``models`` (None: each answers that none is served)."""

    async def embed(model: str | None, inputs: EmbedInputs, truncate: bool) -> EmbedResult:
        if models is None:
            raise ApiError(501, NOT_SERVED, code="not_implemented")
        return await run_in_threadpool(models.embed, model, inputs, truncate)

    async def openai(request: Request) -> Response:
        body = _object(await read_json(request))
        only_known(body, OPENAI_FIELDS, "OpenAI's embeddings API")
        _no_dimensions(body)
        encoding = text_field(body, "encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad(f"encoding_format must be float or base64, not {encoding!r}")
        inputs = openai_inputs(body.get("input"))
        result = await embed(text_field(body, "model") or None, inputs, False)
        return JSONResponse(openai_body(result, encoding))

    async def ollama_embed(request: Request) -> Response:
        body = _object(await read_json(request))
        only_known(body, OLLAMA_EMBED_FIELDS, "Ollama's /api/embed")
        _no_dimensions(body)
        inputs = ollama_inputs(body.get("input"))
        truncate = flag(body, "truncate", default=True)  # Ollama's default: cut to the context
        result = await embed(text_field(body, "model") or None, inputs, truncate)
        return JSONResponse({
            "model": result.model,
            "embeddings": [[float(x) for x in v] for v in result.vectors],
            "total_duration": nanoseconds(result.total_s),
            "load_duration": nanoseconds(result.load_s),
            "prompt_eval_count": result.prompt_tokens,
        })  # fmt: skip

    async def ollama_embeddings(request: Request) -> Response:
        body = _object(await read_json(request))
        only_known(body, OLLAMA_EMBEDDINGS_FIELDS, "Ollama's /api/embeddings")
        prompt = text_field(body, "prompt")
        if not prompt:
            raise bad("prompt must be a non-empty string", "invalid_type")
        result = await embed(text_field(body, "model") or None, [prompt], False)
        return JSONResponse({"embedding": [float(x) for x in result.vectors[0]]})

    return [
        Endpoint("/embeddings", openai),
        Endpoint("/api/embed", ollama_embed, versioned=False),
        Endpoint("/api/embeddings", ollama_embeddings, versioned=False),
    ]


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    return body
