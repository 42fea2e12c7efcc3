"""The configured MCP servers, running beside the app or an ``ask``: their tools, and calls
to them that never take the chat down with them.

The official ``mcp`` SDK is async (anyio) and heavy to import: it is imported only when a
server is configured, and runs on one event loop in a thread of its own, which the rest of
localchat (threads, no event loop of its own in ``ask``) calls into and waits on. Each
server's connection lives in one task, so its context is entered and left there, as anyio
requires. A server's stderr goes to a log file: it would draw over the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from localchat.chat.tools import ToolCall, ToolSpec
from localchat.errors import LocalchatError, one_line
from localchat.paths import ensure_private_dir
from localchat.tools.config import McpServerConfig
from localchat.tools.results import DEFAULT_RESULT_CHARS, ToolResult, failure, limited

if TYPE_CHECKING:
    from mcp import Client


class CallCancelled(Exception):
    """The user stopped a call while it ran."""


class ToolServerError(LocalchatError):
    """A server that cannot be reached as configured (the message says why)."""


T = TypeVar("T")
START_TIMEOUT_S = 30.0  # a server that has not listed its tools by then is reported down
STOP_TIMEOUT_S = 5.0
CANCEL_POLL_S = 0.1  # how often a call's wait looks at its cancel flag


@dataclass
class ServerStatus:
    """One server as ``localchat tools`` and the app's tools screen show it."""

    name: str
    where: str
    state: str = "starting"  # "running", "failed: …", "stopped: …"
    tools: list[ToolSpec] = field(default_factory=list)
    log: Path | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass
class _Link:
    config: McpServerConfig
    status: ServerStatus
    ready: threading.Event = field(default_factory=threading.Event)
    client: Client | None = None
    stop: asyncio.Event | None = None
    late: bool = False  # ``start`` stopped waiting for it: its tools come later, if at all


class ToolServers:
    """Starts the servers, lists their tools (a name two servers share is taken by the first),
    and runs calls: a server that fails to start, dies or times out is a line in its status
    and an error result for the model, never an exception for the chat. A server that
    answers after ``start`` gave up on it runs from then on: ``on_late`` is told its name
    (from the servers' thread), so its tools can be offered."""

    def __init__(
        self,
        configs: tuple[McpServerConfig, ...],
        log_dir: Path,
        result_chars: int = DEFAULT_RESULT_CHARS,
        on_late: Callable[[str], object] | None = None,
    ) -> None:
        self.result_chars = result_chars
        self._on_late = on_late
        self._lock = threading.Lock()  # ``start`` giving up on a server, and it answering
        self._log_dir = log_dir
        self._links = [_Link(c, ServerStatus(c.name, c.where)) for c in configs]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._logs: list[TextIO] = []
        self._tasks: list[Future[None]] = []

    # -- the lifecycle --------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> list[str]:
        """Start every server and wait (at most ``timeout_s``, else ``START_TIMEOUT_S``)
        for each to list its tools; one line for each that did not."""
        if not self._links or self._loop is not None:
            return []
        timeout_s = START_TIMEOUT_S if timeout_s is None else timeout_s
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="mcp-servers", daemon=True)
        self._thread.start()
        self._tasks = [
            asyncio.run_coroutine_threadsafe(self._serve(each), loop) for each in self._links
        ]
        deadline = time.monotonic() + timeout_s  # one wait for all: they start side by side
        for link in self._links:
            if link.ready.wait(max(0.0, deadline - time.monotonic())):
                continue
            with self._lock:
                if not link.status.running:
                    link.late = True
                    link.status.state = f"failed: no answer within {timeout_s:.0f} s"
        return [
            f"MCP server {link.status.name!r} {link.status.state}"
            for link in self._links
            if not link.status.running
        ]

    def close(self) -> None:
        """Stop the servers (their processes end with their connections) and the loop."""
        loop = self._loop
        if loop is None:
            return
        for link in self._links:
            stop = link.stop
            if stop is not None:
                loop.call_soon_threadsafe(stop.set)
        with contextlib.suppress(Exception):
            self._submit(self._all_stopped(), STOP_TIMEOUT_S)
        for task in self._tasks:  # one still connecting (a slow start): given up
            task.cancel()
        for link in self._links:
            link.ready.set()
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
        self._loop = None
        for log in self._logs:
            with contextlib.suppress(OSError):
                log.close()

    # -- what the chat asks -----------------------------------------------------------------
    @property
    def statuses(self) -> list[ServerStatus]:
        return [link.status for link in self._links]

    def tools(self) -> list[ToolSpec]:
        """The tools the servers listed (a name already taken is left out). A server that
        stopped keeps its tools here (a call gets an error result): the tools render at the
        prompt's head, and dropping them would make the model re-read the conversation."""
        seen: dict[str, ToolSpec] = {}
        for link in self._links:
            for tool in link.status.tools:
                seen.setdefault(tool.name, tool)
        return list(seen.values())

    def server_of(self, tool: str) -> str | None:
        """The server whose tool ``tool`` is (None: no running server has it)."""
        link = self._link_of(tool)
        return None if link is None else link.status.name

    def call(self, call: ToolCall, cancel: threading.Event | None = None) -> ToolResult:
        """Run ``call`` on its server and wait for the result (cut to the size limit);
        ``cancel`` set while it runs stops the wait (the model is told so)."""
        link = self._link_of(call.name)
        if link is None:
            return failure(f"no MCP server has a tool named {call.name!r}")
        client = link.client
        if client is None or not link.status.running:
            return failure(f"the MCP server {link.status.name!r} {link.status.state}")
        timeout = link.config.timeout_s
        try:
            result = self._submit(client.call_tool(call.name, call.arguments), timeout, cancel)
        except TimeoutError:
            return failure(f"{call.name} gave no result within {timeout:.0f} s")
        except CallCancelled:
            return failure("the user stopped the call")
        except Exception as exc:  # the server died or broke the protocol: it is down
            link.status.state = f"stopped: {_reason(exc)}"
            if self._loop is not None and link.stop is not None:
                self._loop.call_soon_threadsafe(link.stop.set)
            return failure(f"the MCP server {link.status.name!r} {link.status.state}")
        parts = []
        for block in result.content:
            text = getattr(block, "text", None)
            parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'data')}]")
        return limited("\n".join(parts), bool(result.is_error), self.result_chars)

    # -- on the loop ----------------------------------------------------------------------
    def _link_of(self, tool: str) -> _Link | None:
        """The server whose ``tool`` the model was offered (the first that lists the name),
        running or not: a call never goes to another server the user did not see."""
        having = (each for each in self._links if any(t.name == tool for t in each.status.tools))
        return next(having, None)

    def _submit(
        self,
        coroutine: Coroutine[Any, Any, T],
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> T:
        """Run ``coroutine`` on the loop and wait for it: ``TimeoutError`` past ``timeout_s``,
        ``CallCancelled`` once ``cancel`` is set (it is then cancelled there)."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise CallCancelled
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                try:
                    return future.result(min(left, CANCEL_POLL_S))
                except TimeoutError:
                    continue
        except (TimeoutError, CallCancelled):
            future.cancel()
            raise

    async def _all_stopped(self) -> None:
        while any(link.client is not None for link in self._links):
            await asyncio.sleep(0.02)

    async def _serve(self, link: _Link) -> None:
        """Connect, list the tools, then hold the connection until asked to stop."""
        status = link.status
        link.stop = asyncio.Event()
        try:
            from mcp import Client

            async with Client(self._transport(link.config)) as client:
                tools = await _listed_tools(client)
                with self._lock:
                    status.tools, link.client, status.state = tools, client, "running"
                link.ready.set()
                if link.late and self._on_late is not None:
                    self._on_late(status.name)
                await link.stop.wait()
            if status.running:
                status.state = "stopped"
        except BaseException as exc:
            if status.running or status.state == "starting" or link.late:
                reason = _reason(exc)
                status.state = f"stopped: {reason}" if status.running else f"failed: {reason}"
        finally:
            link.client = None
            link.ready.set()

    def _transport(self, config: McpServerConfig) -> Any:
        """The SDK's transport for ``config``: a subprocess over stdio, or streamable HTTP."""
        if config.url is not None:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            missing = [v for v in config.headers_env.values() if not os.environ.get(v)]
            if missing:
                raise ToolServerError(f"the variable {missing[0]} (headers_env) is not set")
            headers = {k: os.environ[v] for k, v in config.headers_env.items()}
            client = create_mcp_http_client(headers=headers or None)
            return streamable_http_client(config.url, http_client=client)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(
            command=config.command[0],
            args=list(config.command[1:]),
            env=config.env or None,
            cwd=config.cwd,
        )
        return stdio_client(params, errlog=self._log(config.name))

    def _log(self, name: str) -> TextIO:
        """The server's stderr: appended to its log file, readable by the user only."""
        ensure_private_dir(self._log_dir)
        path = self._log_dir / f"mcp-{name}.log"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log = os.fdopen(descriptor, "a", encoding="utf-8")
        self._logs.append(log)
        for link in self._links:
            if link.config.name == name:
                link.status.log = path
        return log


async def _listed_tools(client: Client) -> list[ToolSpec]:
    """Every tool the server lists (all pages), as the templates take them."""
    tools: list[ToolSpec] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        for tool in page.tools:
            schema = dict(tool.input_schema or {"type": "object", "properties": {}})
            schema.pop("title", None)  # the SDK's generated "addArguments": noise in a prompt
            tools.append(ToolSpec(tool.name, tool.description or "", schema))
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _reason(exc: BaseException) -> str:
    """One line for why a server is down (an exception group's first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, FileNotFoundError):
        return f"its command was not found ({exc.filename or exc})"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return one_line(exc) or type(exc).__name__
