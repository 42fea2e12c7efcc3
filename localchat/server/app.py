"""The HTTP side of ``localchat serve``: an ASGI app (Starlette, served by uvicorn) with
one adapter per wire API over the same runner (``server.adapters``): OpenAI's chat and
text completions and Responses, Anthropic's Messages, Ollama's API, and llama-server's own
endpoints. Each route is guarded here (the key, browsers) and every refusal is an error
body in the shape of the API that was asked, with its status, never a traceback; the
model's work runs on the compute thread (``ModelRunner``)."""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localchat.server.adapters import anthropic, llama_server, ollama, openai_chat, responses
from localchat.server.adapters import embeddings as embedding_api
from localchat.server.embeddings import EmbeddingModels
from localchat.server.requests import ApiError
from localchat.server.router import Router
from localchat.server.wire import Endpoint
from localchat.state.responses import ResponseStore

RETRY_AFTER_S = 2
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers, probes)
ErrorShape = Callable[[ApiError], dict[str, Any]]


def _error(exc: ApiError, shape: ErrorShape = openai_chat.error_body) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(shape(exc), status_code=exc.status, headers=headers)


def _error_shape(path: str) -> ErrorShape:
    """The error shape of the API a path belongs to (OpenAI's where none other claims it)."""
    if path.startswith(("/v1/messages", "/messages")):
        return anthropic.error_body
    if path.startswith("/api/"):
        return ollama.error_body
    return openai_chat.error_body


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


class _Guard:
    """What every route checks first: with a key, that the client sent it (``/health``
    aside); without, that the request is not a browser's."""

    def __init__(self, api_key: str | None, loopback: bool) -> None:
        self.api_key, self.loopback = api_key, loopback

    def check(self, request: Request) -> None:
        if request.url.path in OPEN_PATHS:
            return
        if self.api_key is None:
            _refuse_browsers(request, self.loopback)
            return
        if not hmac.compare_digest(_given_key(request).encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>"
                           " (or x-api-key: <key>)", "authentication_error", "invalid_api_key")  # fmt: skip

    def route(self, path: str, endpoint: Endpoint) -> Route:
        shape, handler, check = _error_shape(path), endpoint.handler, self.check

        async def guarded(request: Request) -> Response:
            try:
                check(request)
                return await handler(request)
            except ApiError as exc:
                return _error(exc, shape)

        return Route(path, guarded, methods=list(endpoint.methods))


def _default_responses() -> ResponseStore:
    """Responses kept in the conversation database."""
    from localchat.paths import app_paths
    from localchat.state.store import Store

    return ResponseStore(Store(app_paths().database))


async def _failed(request: Request, exc: Exception) -> Response:
    error = ApiError(500, f"the server failed ({type(exc).__name__}); see its terminal",
                     "server_error")  # fmt: skip
    return _error(error, _error_shape(request.url.path))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     code=code)  # fmt: skip
    return _error(error, _error_shape(request.url.path))


def create_app(
    models: Router,
    api_key: str | None = None,
    loopback: bool = True,
    kept: ResponseStore | None = None,
    cors_origins: tuple[str, ...] = (),
    embeddings: EmbeddingModels | None = None,
) -> Starlette:
    """The server's routes over ``models``; with ``api_key``, every route but /health asks
    for it (``Authorization: Bearer <key>`` or ``x-api-key: <key>``); without, browsers'
    requests are refused (on ``loopback``, also any for another host name). A request for a
    model by a name this server does not know is answered by its default model where the
    router says so (a server of one model: clients that hard-code a model's name just
    work), else a 404 names the models. ``kept``: where the
    Responses API keeps responses (the conversation database, opened at first use).
    ``cors_origins``: pages a browser may let call the API (none by default); their
    requests still pass the key and browser checks (a JSON body, this host's name).
    ``embeddings``: who answers the embeddings endpoints (None: they say none is served)."""
    stores = [kept] if kept is not None else []

    def response_store() -> ResponseStore:
        if not stores:
            stores.append(_default_responses())
        return stores[0]

    endpoints = [
        *llama_server.routes(models),
        *openai_chat.routes(models),
        *responses.routes(models, response_store),
        *anthropic.routes(models),
        *ollama.routes(models),
        *embedding_api.routes(embeddings),
    ]
    guard = _Guard(api_key, loopback)
    routes = []
    for endpoint in endpoints:
        prefixes = ("/v1", "") if endpoint.versioned else ("",)
        routes += [guard.route(prefix + endpoint.path, endpoint) for prefix in prefixes]
    middleware = []
    if cors_origins:
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(cors_origins), allow_headers=["*"],
            allow_methods=["GET", "POST", "DELETE", "HEAD"],
        ))  # fmt: skip
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={Exception: _failed, HTTPException: _http_error},
    )


class BackgroundServer:
    """``models`` served by uvicorn on a free loopback port, in a thread of this process:
    what the tests and the bench talk to through real clients. ``close()`` stops it (the
    models are the caller's)."""

    def __init__(
        self,
        models: Router,
        api_key: str | None = None,
        cors_origins: tuple[str, ...] = (),
        embeddings: EmbeddingModels | None = None,
    ) -> None:
        import uvicorn

        app = create_app(models, api_key, cors_origins=cors_origins, embeddings=embeddings)
        config = uvicorn.Config(app, "127.0.0.1", 0, log_level="warning")
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
