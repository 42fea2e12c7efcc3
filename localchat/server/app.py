"""The HTTP side of ``localchat serve``: an ASGI app (Starlette, served by uvicorn) speaking
OpenAI's API — chat and text completions, streamed as server-sent events ending with
``data: [DONE]`` — and llama-server's ``/tokenize``, ``/detokenize``, ``/health`` and
``/metrics``. Every refusal is an OpenAI-shaped error body with its status, never a
traceback; the model's work runs on the compute thread (``ModelRunner``)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from localchat.backends.base import TurnStats
from localchat.chat.tool_stream import ToolCallStream
from localchat.chat.tools import parse_tool_calls
from localchat.server.api import (
    ApiError,
    GenerationRequest,
    completion_body,
    delta_chunk,
    final_chunks,
    parse_request,
)
from localchat.server.runner import ModelRunner

MAX_BODY_BYTES = 8 * 2**20  # a long conversation with files fits; more is refused
DRAIN_LIMIT_BYTES = 64 * 2**20
RETRY_AFTER_S = 2
DISCONNECT_POLL_S = 0.25
# A stream's pieces reach the client at most this often, those of the meantime together:
# each wake of the event loop and of the client preempts a llama.cpp thread on a small
# machine (per token they cost a stream ~5% of its speed on 2 cores; over a 300-token
# stream the loop took 0.07-0.09 s of CPU at 25 ms, 0.03-0.05 s at 50 ms, the client 0.03
# and 0.02 s). 20 updates a second read as smooth (the app redraws at most 10 times a
# second). The first piece and the end go out at once.
STREAM_INTERVAL_S = 0.05
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers, probes)
_RUNNING: set[asyncio.Task[None]] = set()  # turns whose client left, still ending


def _error(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


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


def create_app(runner: ModelRunner, api_key: str | None = None, loopback: bool = True) -> Starlette:
    """The server's routes over ``runner``; with ``api_key``, every route but /health asks
    for ``Authorization: Bearer <key>``; without, browsers' requests are refused (on
    ``loopback``, also any for another host name)."""
    names = runner.aliases()

    def check_key(request: Request) -> None:
        if request.url.path in OPEN_PATHS:
            return
        if api_key is None:
            _refuse_browsers(request, loopback)
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>",
                           "authentication_error", "invalid_api_key")  # fmt: skip

    async def guarded(request: Request, handler: Any) -> Response:
        try:
            check_key(request)
            response: Response = await handler(request)
            return response
        except ApiError as exc:
            return _error(exc)

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
        return await _generate(runner, await _request_of(request, names, True), request)

    async def complete(request: Request) -> Response:
        return await _generate(runner, await _request_of(request, names, False), request)

    def route(path: str, handler: Any, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            return await guarded(request, handler)

        return Route(path, endpoint, methods=methods)

    async def failed(_request: Request, exc: Exception) -> Response:
        return _error(
            ApiError(
                500, f"the server failed ({type(exc).__name__}); see its terminal", "server_error"
            )
        )

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(ApiError(exc.status_code, str(exc.detail), code="not_found"))

    return Starlette(
        routes=[
            route("/health", health, ["GET"]),
            route("/v1/models", models, ["GET"]),
            route("/models", models, ["GET"]),
            route("/metrics", metrics, ["GET"]),
            route("/tokenize", tokenize, ["POST"]),
            route("/detokenize", detokenize, ["POST"]),
            route("/v1/chat/completions", chat, ["POST"]),
            route("/chat/completions", chat, ["POST"]),
            route("/v1/completions", complete, ["POST"]),
            route("/completions", complete, ["POST"]),
        ],
        exception_handlers={Exception: failed, HTTPException: http_error},
    )


async def _request_of(request: Request, names: set[str], chat: bool) -> GenerationRequest:
    parsed = parse_request(await _json_body(request), chat)
    if parsed.model and parsed.model not in names:
        raise ApiError(404, f"no model {parsed.model!r} here; this server runs {sorted(names)[0]!r}"
                       " (GET /v1/models)", code="model_not_found")  # fmt: skip
    return parsed


class _Turn:
    """One request's work, all of it on one worker thread: the prompt rendered and tokenized,
    then the reply, without a hand-back to the event loop between the two (beside running
    replies each hand-over waits for a time slice, and a request joining them paid two before
    its job was queued). The loop learns from ``prompt_ready`` whether the prompt was taken
    (a refusal comes before any stream starts); the reply's pieces come as ``events``."""

    def __init__(self, runner: ModelRunner, request: GenerationRequest) -> None:
        self.runner, self.request = runner, request
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self.prompt_ready: asyncio.Future[None] = self.loop.create_future()
        self.events = _Pieces(self.loop)
        self.task = asyncio.create_task(self._run())

    def emit(self, kind: str, text: str) -> None:
        """A piece of the reply (called on the compute thread)."""
        self.events.put(kind, text)

    async def _run(self) -> None:
        try:
            stats = await run_in_threadpool(self._work)
        except Exception as exc:
            self.events.put("error", exc)
            return
        self.events.put("done", stats)

    def _work(self) -> TurnStats:
        try:
            job = self.runner.job_of(self.request, self.cancel, self.emit)
        except BaseException as exc:
            self.runner.leave_queue()  # admitted, never queued
            self.loop.call_soon_threadsafe(_settle, self.prompt_ready, exc)
            raise
        self.loop.call_soon_threadsafe(_settle, self.prompt_ready, None)
        return self.runner.run(job)

    def stop(self) -> None:
        """The client went away: the turn stops at its next token (or is never started);
        its task ends on its own."""
        self.cancel.set()
        _RUNNING.add(self.task)
        self.task.add_done_callback(_RUNNING.discard)


class _Pieces:
    """A reply's pieces from the compute thread to the event loop, in batches: the loop is
    woken when it waits for the first piece or for the end, and otherwise collects what came
    every ``STREAM_INTERVAL_S`` (a wake per batch, not per token)."""

    ENDS = ("done", "error")
    WAKE = ("end", *ENDS)  # "end": the reply's text is all out (its state is being saved)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[str, Any]] = []
        self.waiting = True  # the loop found nothing and sleeps until woken
        self.wake = asyncio.Event()

    def put(self, kind: str, value: Any) -> None:
        """One piece (any thread)."""
        with self.lock:
            self.pending.append((kind, value))
            signal = self.waiting or kind in self.WAKE
            self.waiting = False
        if signal:
            self.loop.call_soon_threadsafe(self.wake.set)

    async def batches(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """What came since the last batch, until a batch ends with ``done`` or ``error``."""
        while True:
            self.wake.clear()  # a wake from here on is news
            with self.lock:
                batch, self.pending = self.pending, []
                self.waiting = not batch
            if not batch:
                await self.wake.wait()
                continue
            yield batch
            if batch[-1][0] in self.ENDS:
                return
            with contextlib.suppress(TimeoutError):  # cut short by the end
                await asyncio.wait_for(self.wake.wait(), STREAM_INTERVAL_S)


def _settle(future: asyncio.Future[None], outcome: BaseException | None) -> None:
    if future.done():
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)


async def _generate(runner: ModelRunner, request: GenerationRequest, http: Request) -> Response:
    """Admit, tokenize (a prompt the context cannot hold is refused before any stream
    starts), then stream the reply or return it whole."""
    runner.admit()
    if request.model == "":
        request = replace(request, model=runner.model_name)
    turn = _Turn(runner, request)
    try:
        await turn.prompt_ready
    except BaseException:
        turn.stop()
        raise
    if request.stream:
        return EventSourceResponse(_stream(turn), ping=15)
    pieces: dict[str, list[str]] = {"text": [], "reasoning": []}
    watcher = asyncio.create_task(_cancel_when_gone(http, turn.cancel))
    stats: TurnStats | None = None
    try:
        async for batch in turn.events.batches():
            for kind, value in batch:
                if kind == "error":
                    raise value
                if kind == "done":
                    stats = value
                elif kind in pieces:
                    pieces[kind].append(value)
    except BaseException:
        turn.stop()
        raise
    finally:
        watcher.cancel()
    text, calls = "".join(pieces["text"]), None
    if request.tool_use.reads_calls:
        content, calls = parse_tool_calls(
            text, runner.engine.template.tool_family, request.tool_use.names
        )
        text = content if calls else text
    assert stats is not None  # the batches end with "done" or raise
    body = completion_body(request, text, "".join(pieces["reasoning"]), stats, calls)
    return JSONResponse(body)


def _tool_calls_stream(runner: ModelRunner, request: GenerationRequest) -> ToolCallStream | None:
    """Where the reply is read for calls: a stream that holds them back, in the model's format."""
    if not request.tool_use.reads_calls:
        return None
    return ToolCallStream(runner.engine.template.tool_family, request.tool_use.names)


async def _cancel_when_gone(http: Request, cancel: threading.Event) -> None:
    """A whole-body request whose client left (a timeout, an editor's retry) stops its turn."""
    while not cancel.is_set():
        if await http.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _stream(turn: _Turn) -> AsyncIterator[bytes]:
    """The reply as SSE events, those of a batch in one write; a client that goes away stops
    its sequence at once (what was generated stays in the cache)."""
    request = turn.request
    calls_stream = _tool_calls_stream(turn.runner, request)
    try:
        yield _events([json.dumps(delta_chunk(request, first=True))])
        async for batch in turn.events.batches():
            data = [line for piece in batch for line in _data_of(request, piece, calls_stream)]
            if data:  # not all of it a call's text, held back
                yield _events(data)
    finally:
        turn.stop()  # the turn stops at its next token; its task ends on its own


def _data_of(
    request: GenerationRequest, piece: tuple[str, Any], calls_stream: ToolCallStream | None
) -> list[str]:
    """The data lines of one piece of the reply: a delta, or the end (the text held back,
    the calls, the usage, ``[DONE]``), or the error that ended it; none for "end" (it only
    wakes the loop for the last text)."""
    kind, value = piece
    if kind == "done":
        data, calls = [], None
        if calls_stream is not None:  # the text held back, then the calls
            rest, calls = calls_stream.finish()
            if rest.strip() if calls else rest:
                data.append(json.dumps(delta_chunk(request, rest.rstrip() if calls else rest)))
        data += [json.dumps(chunk) for chunk in final_chunks(request, value, calls)]
        return [*data, "[DONE]"]
    if kind == "error":
        error = (
            value
            if isinstance(value, ApiError)
            else ApiError(
                500, f"the server failed: {type(value).__name__}: {value}", "server_error"
            )
        )
        return [json.dumps(error.body())]
    if kind == "end":
        return []  # the usage and [DONE] come with "done"
    if calls_stream is not None and kind == "text":
        value = calls_stream.feed(value)
        if not value:
            return []
    return [json.dumps(delta_chunk(request, value, reasoning=kind == "reasoning"))]


def _events(data: list[str]) -> bytes:
    """SSE events, one per data line, as one chunk of the response."""
    return b"".join(ServerSentEvent(line).encode() for line in data)


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
