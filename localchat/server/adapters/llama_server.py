"""llama-server's own endpoints, which its clients (and other localchats) read:
``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``, ``/props``, and ``/v1/models``
with llama-server's ``meta``. Tokenizing does not wait behind a running reply: llama.cpp's
tokenizer reads the vocabulary only (as llama-server tokenizes in its HTTP threads while
its loop decodes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from localchat.server.model_facts import ServedModel, served_model, served_models
from localchat.server.requests import ApiError
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.server.wire import Endpoint, read_json

if TYPE_CHECKING:
    from localchat.backends.llama.engine import Engine


def piece(data: bytes) -> str | list[int]:
    """A token's piece as llama-server's ``with_pieces`` gives it: its text, or its bytes
    where they are not whole UTF-8 (part of a character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def routes(models: Router) -> list[Endpoint]:
    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(_request: Request) -> Response:
        text = _models_metrics(models.loaded())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def listed(_request: Request) -> Response:
        return JSONResponse(_models_body(await run_in_threadpool(served_models, models)))

    async def props(request: Request) -> Response:
        async with models.hold(request.query_params.get("model")) as runner:
            facts = await run_in_threadpool(served_model, models, runner.model_name)
            return JSONResponse(_props_body(facts, runner.engine))

    async def tokenize(request: Request) -> Response:
        body = await read_json(request)
        async with models.hold(_model_field(body)) as runner:
            return await _tokenize(runner.engine, body)

    async def detokenize(request: Request) -> Response:
        body = await read_json(request)
        async with models.hold(_model_field(body)) as runner:
            return await _detokenize(runner.engine, body)

    async def load(request: Request) -> Response:
        name = _named_model(await read_json(request))
        async with models.hold(name):
            return JSONResponse({"success": True})

    async def unload(request: Request) -> Response:
        name = _named_model(await read_json(request))
        unloaded = await run_in_threadpool(models.unload, name)
        return JSONResponse({"success": True, "unloaded": unloaded})

    return [
        Endpoint("/health", health, ("GET",), versioned=False),
        Endpoint("/metrics", metrics, ("GET",), versioned=False),
        Endpoint("/tokenize", tokenize, versioned=False),
        Endpoint("/detokenize", detokenize, versioned=False),
        Endpoint("/props", props, ("GET",), versioned=False),
        Endpoint("/models", listed, ("GET",)),
        Endpoint("/models/load", load, versioned=False),
        Endpoint("/models/unload", unload, versioned=False),
    ]


def _model_field(body: Any) -> str | None:
    """A body's optional ``model`` (llama-server's router reads it on every endpoint)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _named_model(body: Any) -> str:
    """``/models/load`` and ``/models/unload`` name their model: ``{"model": NAME}``."""
    name = _model_field(body)
    if not name:
        raise ApiError(400, 'name the model: {"model": NAME}', code="invalid_value")
    return name


def _prometheus_text(rows: list[tuple[str, str, str, float]]) -> str:
    lines = []
    for name, kind, text, value in rows:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def _models_metrics(loaded: list[ModelRunner]) -> str:
    """The loaded models' figures, summed (a cache's fill: the fullest model's), and how
    many models are loaded."""
    totals: dict[str, tuple[str, str, float]] = {
        "llamacpp:requests_processing": ("gauge", "requests running", 0.0),
        "llamacpp:requests_deferred": ("gauge", "requests waiting", 0.0),
        "localchat:saves_pending": ("gauge", "states queued or being written to disk", 0.0),
    }  # what a server with no model loaded says too
    for runner in loaded:
        for name, kind, text, value in runner.metric_rows():
            before = totals.get(name, (kind, text, 0.0))[2]
            merged = max(before, value) if name.endswith(("_ratio", "_seconds")) else before + value
            totals[name] = (kind, text, merged)
    rows = [(name, kind, text, value) for name, (kind, text, value) in totals.items()]
    rows.append(("localchat:models_loaded", "gauge", "models in memory", len(loaded)))
    return _prometheus_text(rows)


def _models_body(served: list[ServedModel]) -> dict[str, Any]:
    """``/v1/models`` with llama-server's ``meta`` on each name (what its clients read the
    context and size from) and its router's ``status`` (loaded, loading, unloaded)."""
    entries = []
    for model in served:
        meta = {"n_ctx": model.n_ctx, "n_ctx_train": model.n_ctx_train,
                "n_vocab": model.n_vocab, "n_params": model.parameters,
                "size": model.size_bytes}  # fmt: skip
        entries += [{"id": name, "object": "model", "created": int(model.modified_at),
                     "owned_by": "localchat", "meta": meta, "path": str(model.path),
                     "status": {"value": model.status}} for name in model.names]  # fmt: skip
    return {"object": "list", "data": entries}


def _props_body(model: ServedModel, engine: Engine) -> dict[str, Any]:
    """``/props``: the slots, template and special tokens as llama-server reports them."""
    settings = {"n_ctx": model.n_ctx, "model": model.name,
                "params": {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.05,
                           "n_predict": -1}}  # fmt: skip
    return {
        "default_generation_settings": settings, "total_slots": model.slots,
        "model_path": str(engine.model_path), "model_alias": model.name,
        "chat_template": model.template, "modalities": {"vision": "vision" in model.capabilities, "audio": False},
        "bos_token": engine.template.bos_token, "eos_token": engine.template.eos_token,
        "build_info": "localchat",
    }  # fmt: skip


async def _tokenize(engine: Engine, body: Any) -> Response:
    """``/tokenize``: the content's token ids (``with_pieces``: each with its piece)."""
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, str):
        raise ApiError(400, "content must be a string", code="invalid_type")
    special = bool(body.get("add_special", False))

    def pieces() -> list[int] | list[dict[str, Any]]:
        tokens = engine.tokenize(
            content,
            add_bos=special and engine.add_bos,
            special=bool(body.get("parse_special", True)),
        )
        if body.get("with_pieces"):
            return [{"id": t, "piece": piece(engine.token_bytes(t))} for t in tokens]
        return tokens

    return JSONResponse({"tokens": await run_in_threadpool(pieces)})


async def _detokenize(engine: Engine, body: Any) -> Response:
    """``/detokenize``: the ids' text; an id outside the vocabulary is refused."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    n_vocab = engine.n_vocab
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in tokens
    ):
        raise ApiError(400, f"tokens must be a list of ids from 0 to {n_vocab - 1}",
                       code="invalid_type")  # fmt: skip
    text = await run_in_threadpool(engine.detokenize, tokens, True)
    return JSONResponse({"content": text})
