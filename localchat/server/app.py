"""The HTTP side of ``localchat serve``: an ASGI app (Starlette, served by uvicorn) with
one adapter per wire API over the same runner (``server.adapters``): OpenAI's chat and
text completions, Anthropic's Messages, and llama-server's ``/tokenize``, ``/detokenize``,
``/health`` and ``/metrics``. Every refusal is an error body in the shape of the API that
was asked, with its status, never a traceback; the model's work runs on the compute thread
(``ModelRunner``)."""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from localchat.server.adapters import anthropic, openai_chat
from localchat.server.requests import ApiError
from localchat.server.runner import ModelRunner

MAX_BODY_BYTES = 8 * 2**20  # a long conversation with files fits; more is refused
DRAIN_LIMIT_BYTES = 64 * 2**20
RETRY_AFTER_S = 2
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers, probes)
Handler = Callable[[Request], Awaitable[Response]]
ErrorShape = Callable[[ApiError], dict[str, Any]]


def _error(exc: ApiError, shape: ErrorShape = openai_chat.error_body) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(shape(exc), status_code=exc.status, headers=headers)


def _error_shape(path: str) -> ErrorShape:
    """The error shape of the API a path belongs to (OpenAI's where none other claims it)."""
    if path.startswith(("/v1/messages", "/messages")):
        return anthropic.error_body
    return openai_chat.error_body


async def _json_body(request: Request) -> Any:
    """The request's JSON; a body over ``MAX_BODY_BYTES`` is read to its end (so the client
    gets the answer rather than a broken pipe; ``DRAIN_LIMIT_BYTES`` at most) and refused."""
    raw = bytearray()
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            raw += chunk
        elif size > DRAIN_LIMIT_BYTES:
            break
    if size > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES // 2**20} MiB", code="too_large")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})", code="invalid_json") from None


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
# What a web page may POST without asking the browser first: never a model's request here.
BROWSER_SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def _host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "[::1]")."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0]


def _refuse_browsers(request: Request, loopback: bool) -> None:
    """Without a key, only this machine's own clients: a body a web page may send unasked
    (a form, plain text) is refused, and on loopback a request for another host name (a
    page's DNS rebinding)."""
    host = _host_name(request.headers.get("host", ""))
    if loopback and host and host not in LOOPBACK_HOSTS:
        raise ApiError(403, f"this server answers on loopback only, not for host {host!r};"
                       " give it --api-key to serve other names", "permission_error", "forbidden_host")  # fmt: skip
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method == "POST" and kind in BROWSER_SIMPLE_TYPES:
        raise ApiError(415, "send the body as application/json (Content-Type: application/json)",
                       code="unsupported_media_type")  # fmt: skip


def _given_key(request: Request) -> str:
    """The key a client sent: OpenAI's ``Authorization: Bearer`` or Anthropic's
    ``x-api-key``."""
    bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return bearer or request.headers.get("x-api-key", "").strip()


def create_app(runner: ModelRunner, api_key: str | None = None, loopback: bool = True) -> Starlette:
    """The server's routes over ``runner``; with ``api_key``, every route but /health asks
    for it (``Authorization: Bearer <key>`` or ``x-api-key: <key>``); without, browsers'
    requests are refused (on ``loopback``, also any for another host name). A request for a
    model by a name this server does not know is answered by its model, whose name the
    response gives (clients that hard-code a model's name just work)."""

    def check_key(request: Request) -> None:
        if request.url.path in OPEN_PATHS:
            return
        if api_key is None:
            _refuse_browsers(request, loopback)
            return
        if not hmac.compare_digest(_given_key(request).encode(), api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>"
                           " (or x-api-key: <key>)", "authentication_error", "invalid_api_key")  # fmt: skip

    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_request: Request) -> Response:
        engine = runner.engine
        entry = {
            "id": runner.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "localchat",
            "meta": {"n_ctx": runner.batch.n_ctx_seq, "n_ctx_train": engine.info.context_length,
                     "n_vocab": engine.n_vocab},
        }  # fmt: skip
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics(_request: Request) -> Response:
        return PlainTextResponse(runner.metrics(), media_type="text/plain; version=0.0.4")

    async def tokenize(request: Request) -> Response:
        body = await _json_body(request)
        content = body.get("content") if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise ApiError(400, "content must be a string", code="invalid_type")
        special = bool(body.get("add_special", False))
        engine = runner.engine

        def pieces() -> list[int] | list[dict[str, Any]]:
            tokens = engine.tokenize(
                content,
                add_bos=special and engine.add_bos,
                special=bool(body.get("parse_special", True)),
            )
            if body.get("with_pieces"):
                return [{"id": t, "piece": engine.token_text(t)} for t in tokens]
            return tokens

        # Not behind a running reply: llama.cpp's tokenizer reads the vocabulary only (as
        # llama-server tokenizes in its HTTP threads while its loop decodes).
        return JSONResponse({"tokens": await run_in_threadpool(pieces)})

    async def detokenize(request: Request) -> Response:
        body = await _json_body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        n_vocab = runner.engine.n_vocab
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in tokens
        ):
            raise ApiError(400, f"tokens must be a list of ids from 0 to {n_vocab - 1}",
                           code="invalid_type")  # fmt: skip
        text = await run_in_threadpool(runner.engine.detokenize, tokens, True)
        return JSONResponse({"content": text})

    async def chat(request: Request) -> Response:
        parsed = openai_chat.parse_request(await _json_body(request), chat=True)
        return await openai_chat.respond(runner, parsed, request)

    async def complete(request: Request) -> Response:
        parsed = openai_chat.parse_request(await _json_body(request), chat=False)
        return await openai_chat.respond(runner, parsed, request)

    async def messages(request: Request) -> Response:
        parsed = anthropic.parse_request(await _json_body(request))
        return await anthropic.respond(runner, parsed, request)

    async def count_tokens(request: Request) -> Response:
        parsed = anthropic.parse_count(await _json_body(request))
        return await anthropic.count_tokens(runner, parsed)

    def route(path: str, handler: Handler, methods: list[str]) -> Route:
        shape = _error_shape(path)

        async def endpoint(request: Request) -> Response:
            try:
                check_key(request)
                return await handler(request)
            except ApiError as exc:
                return _error(exc, shape)

        return Route(path, endpoint, methods=methods)

    async def failed(request: Request, exc: Exception) -> Response:
        error = ApiError(500, f"the server failed ({type(exc).__name__}); see its terminal",
                         "server_error")  # fmt: skip
        return _error(error, _error_shape(request.url.path))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "method_not_allowed"
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code=code)  # fmt: skip
        return _error(error, _error_shape(request.url.path))

    routes = [
        route("/health", health, ["GET"]),
        route("/metrics", metrics, ["GET"]),
        route("/tokenize", tokenize, ["POST"]),
        route("/detokenize", detokenize, ["POST"]),
    ]
    for prefix in ("/v1", ""):  # clients given a base URL with or without /v1
        routes += [
            route(f"{prefix}/models", models, ["GET"]),
            route(f"{prefix}/chat/completions", chat, ["POST"]),
            route(f"{prefix}/completions", complete, ["POST"]),
            route(f"{prefix}/messages", messages, ["POST"]),
            route(f"{prefix}/messages/count_tokens", count_tokens, ["POST"]),
        ]
    return Starlette(
        routes=routes,
        exception_handlers={Exception: failed, HTTPException: http_error},
    )


class BackgroundServer:
    """``runner`` served by uvicorn on a free loopback port, in a thread of this process:
    what the tests and the bench talk to through real clients. ``close()`` stops it (the
    runner is the caller's)."""

    def __init__(self, runner: ModelRunner, api_key: str | None = None) -> None:
        import uvicorn

        config = uvicorn.Config(create_app(runner, api_key), "127.0.0.1", 0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="serve", daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the server did not start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.root = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
