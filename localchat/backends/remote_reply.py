"""A reply streaming from an OpenAI-compatible server: its events read into text, reasoning
and figures as they arrive.

The connection is the backend's (``remote.py`` holds the wire): a reply reads the events'
data it hands over, hangs it up when the user cancels, and closes it however reading ends.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from localchat.backends.base import TokenDelta, TurnStats
from localchat.backends.remote_errors import ERROR_TEXT_LIMIT, RemoteError
from localchat.chat.reasoning import CLOSE, OPEN, ReasoningStream, split_reasoning
from localchat.chat.tools import ToolCall, new_call_id
from localchat.text import shown

# How often a waiting stream looks at the cancel flag (a slow first token is cancellable).
CANCEL_POLL_S = 0.05


class EventStream(Protocol):
    """A reply's open connection to the server."""

    def data(self) -> Iterator[str]:
        """Each event's data as it arrives (a broken connection raises RemoteError)."""
        ...

    def hang_up(self) -> None:
        """Wake a reader blocked on the socket and tell the server to stop."""
        ...

    def close(self) -> None: ...


class ReplyServer(Protocol):
    """What a reply reads of the backend that opened it (``RemoteBackend``): the server's
    name for its errors, and its cache's fill after the reply."""

    @property
    def server(self) -> str: ...

    def cache_usage(self) -> float | None: ...


@dataclass
class RemoteReply:
    """A reply streaming from the server: iterate for deltas; the stream is closed however
    iteration ends, and a cancel closes the connection so the server stops generating."""

    backend: ReplyServer
    _connection: EventStream
    _sent_at: float
    _cancel: threading.Event | None
    _prompt_estimate: int
    stats: TurnStats = field(default_factory=TurnStats)
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    chunks: int = 0  # content-bearing events: about one token each on llama.cpp servers
    _closed: threading.Event = field(default_factory=threading.Event)
    _close_lock: threading.Lock = field(default_factory=threading.Lock)
    _ended: bool = False  # the server said the reply is over ([DONE] or a finish reason)
    _thinking: bool = False  # inside reasoning the server sends apart from the content
    _server_generated: int | None = None  # the server's own count of the reply's tokens
    _first_at: float = 0.0  # when the first and the latest content-bearing events came
    _last_at: float = 0.0
    # Tool calls as the server streams them (OpenAI's fragments by index), read at the end.
    tool_calls: list[ToolCall] = field(default_factory=list)
    _call_parts: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def answer(self) -> str:
        return split_reasoning(self.text)[1]

    @property
    def reasoning(self) -> str:
        return split_reasoning(self.text)[0]

    def __iter__(self) -> Iterator[TokenDelta]:
        watcher = threading.Thread(target=self._watch_cancel, name="remote-cancel", daemon=True)
        watcher.start()
        failed = False
        try:
            yield from self._read()
        except RemoteError:
            self.stats.stop_reason = "error"  # what arrived is kept, as a partial reply
            failed = True
            raise
        except BaseException:  # the reader stopped early (Ctrl-C, a closed iterator)
            if not self._ended:
                self.stats.stop_reason = "cancelled"
            failed = True
            raise
        finally:
            self._close()
            self._settle()
            if not failed and not self._cancelled():
                self.stats.server_kv_usage = self.backend.cache_usage()

    def _settle(self) -> None:
        """The figures however the reply ended (finished, stopped, cut): a reasoning block
        left open is closed in the text; the prompt's rate from what the server said, else
        from the first token's wait."""
        stats = self.stats
        if self._thinking:
            self.text += CLOSE
            self._thinking = False
        stats.prompt_tokens_evaluated = stats.prompt_tokens_evaluated or stats.prompt_tokens
        if not stats.prompt_tps and stats.ttft_s > 0:
            stats.prompt_tps = stats.prompt_tokens_evaluated / stats.ttft_s

    def _cancelled(self) -> bool:
        return self._cancel is not None and self._cancel.is_set()

    def _watch_cancel(self) -> None:
        """Hang up as soon as the user cancels, even while the server is still reading the
        prompt and sends nothing (no event arrives to look at the flag)."""
        while not self._closed.wait(CANCEL_POLL_S):
            if self._cancelled():
                self._connection.hang_up()
                return

    def _close(self) -> None:
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        with contextlib.suppress(Exception):
            self._connection.close()

    def _read(self) -> Iterator[TokenDelta]:
        """The reply's deltas as its events arrive; its figures, tool calls and how it ended
        are kept on the reply."""
        self._start_stats()
        reasoning = ReasoningStream(False)
        finished = False
        for event_data in self._connection.data():
            if self._cancelled():
                break
            data = event_data.strip()
            if data == "[DONE]":
                finished = self._ended = True
                break
            if not data:
                continue
            chunk = self._parse_event(data)
            self._read_figures(chunk)
            for choice in chunk.get("choices") or []:
                if isinstance(choice, dict):
                    yield from self._read_choice(choice, reasoning)
        else:
            finished = finished or self._cancelled()
        if self._cancelled():
            self.stats.stop_reason = "cancelled"
            return
        for is_reasoning, text in reasoning.flush():
            yield TokenDelta(None, text, is_reasoning)
        if not finished:
            raise RemoteError(
                f"{self.backend.server}: the stream ended before the reply did; the partial"
                " reply is kept"
            )
        self._count_generated()
        self.tool_calls = self._calls()

    def _start_stats(self) -> None:
        """The figures before the server says any: the prompt as estimated here, and a
        reply cut by its length unless an event says otherwise."""
        stats = self.stats
        stats.kv_bytes_used = stats.kv_bytes_allocated = None
        stats.prompt_tokens = self._prompt_estimate
        stats.counted = "estimated"  # until the server's usage report says otherwise
        stats.stop_reason = "length"

    def _parse_event(self, data: str) -> dict[str, Any]:
        """An event's JSON object; a malformed event or the server's error raises (the
        partial reply is kept)."""
        server = self.backend.server
        try:
            chunk = json.loads(data)
        except ValueError:
            raise RemoteError(
                f"{server} sent a malformed event ({shown(data, 60)}); the partial reply is kept"
            ) from None
        if not isinstance(chunk, dict):
            raise RemoteError(f"{server} sent an event that is not a JSON object")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise RemoteError(
                f"{server} failed mid-reply ({shown(str(message), ERROR_TEXT_LIMIT)});"
                " the partial reply is kept"
            )
        return chunk

    def _read_choice(
        self, choice: dict[str, Any], reasoning: ReasoningStream
    ) -> Iterator[TokenDelta]:
        """One choice's delta: its text yielded (timed as it arrives), then its finish
        reason noted."""
        parts = self._read_delta(choice.get("delta") or {}, reasoning)
        if parts:
            self._arrived()
            for is_reasoning, text in parts:
                yield TokenDelta(None, text, is_reasoning)
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self.stats.stop_reason = {"stop": "eos"}.get(reason, reason)
            self._ended = True

    def _read_delta(
        self, delta: dict[str, Any], reasoning: ReasoningStream
    ) -> list[tuple[bool, str]]:
        """A delta's reasoning and content added to the text, as (is reasoning, text)
        pieces for the reader; its tool-call fragments joined."""
        parts: list[tuple[bool, str]] = []
        # A server that parses reasoning sends it apart; the transcript keeps it as the
        # model wrote it, inside <think>…</think>.
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(thought, str) and thought:
            if not self._thinking:
                self.text += OPEN
                self._thinking = True
            parts.append((True, thought))
            self.text += thought
        self._read_call_fragments(delta.get("tool_calls"))
        content = delta.get("content")
        if isinstance(content, str) and content:
            if self._thinking:
                self.text += CLOSE + "\n"
                self._thinking = False
            self.text += content
            parts.extend(reasoning.feed(content))
        return parts

    def _arrived(self) -> None:
        """A content-bearing event came: the first one's wait, then the count and rate."""
        now = time.perf_counter()
        if not self.chunks:
            self._first_at = now
            self.stats.ttft_s = now - self._sent_at
            self.stats.first_token_at = now
        self.chunks += 1
        self._last_at = now
        self._count_generated()

    def _read_call_fragments(self, fragments: object) -> None:
        """Join the pieces of each streamed call (its id and name come once, its arguments
        as JSON text in pieces)."""
        if not isinstance(fragments, list):
            return
        for fragment in fragments:
            if not isinstance(fragment, dict):
                continue
            index = fragment.get("index", len(self._call_parts))
            part = self._call_parts.setdefault(index if isinstance(index, int) else 0, {})
            function = fragment.get("function") or {}
            for key, value in (
                ("id", fragment.get("id")),
                ("name", function.get("name") if isinstance(function, dict) else None),
            ):
                if isinstance(value, str) and value:
                    part[key] = value
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                part["arguments"] = part.get("arguments", "") + arguments

    def _calls(self) -> list[ToolCall]:
        """The calls the server sent, complete; one whose arguments are not a JSON object
        is an error the partial reply keeps."""
        calls = []
        for index in sorted(self._call_parts):
            part = self._call_parts[index]
            try:
                arguments = json.loads(part.get("arguments") or "{}")
            except ValueError:
                arguments = None
            if not part.get("name") or not isinstance(arguments, dict):
                why = (
                    "the reply reached its length limit in the middle of a tool call"
                    if self.stats.stop_reason == "length"
                    else f"{self.backend.server} sent a tool call that is not a name and JSON"
                    " arguments"
                )
                raise RemoteError(f"{why}; the partial reply is kept")
            calls.append(ToolCall(part["name"], arguments, part.get("id") or new_call_id()))
        return calls

    def _count_generated(self) -> None:
        """Tokens written and their rate, by the server's count where it sent one."""
        stats = self.stats
        stats.generated_tokens = self._server_generated or self.chunks
        if stats.generated_tokens > 1 and self._last_at > self._first_at:
            stats.gen_tps = (stats.generated_tokens - 1) / (self._last_at - self._first_at)

    def _read_figures(self, chunk: dict[str, Any]) -> None:
        """The server's own counts: OpenAI ``usage`` (vLLM, llama-server, Ollama) and
        llama-server's ``timings`` (what it evaluated, what its cache already held)."""
        stats = self.stats
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                stats.prompt_tokens = usage["prompt_tokens"]
                stats.prompt_tokens_evaluated = (
                    stats.prompt_tokens_evaluated or usage["prompt_tokens"]
                )
            if isinstance(usage.get("completion_tokens"), int):
                self._server_generated = usage["completion_tokens"]
            stats.counted = "server"
        timings = chunk.get("timings")
        if isinstance(timings, dict):
            if isinstance(timings.get("prompt_n"), int):
                stats.prompt_tokens_evaluated = timings["prompt_n"]
            rate = timings.get("prompt_per_second")
            if isinstance(rate, (int, float)) and rate > 0:
                stats.prompt_tps = float(rate)
