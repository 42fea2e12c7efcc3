"""Server-sent events as one chunk of a response (the events of a batch in one write)."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette.event import ServerSentEvent


def sse(data: list[str], event: str | None = None) -> bytes:
    """SSE events, one per data line (each of type ``event`` where given)."""
    return b"".join(ServerSentEvent(line, event=event).encode() for line in data)


def sse_json(items: list[tuple[str, dict[str, Any]]]) -> bytes:
    """Typed SSE events (``event:`` and a JSON ``data:`` line each), as Anthropic's and the
    Responses API's streams are."""
    return b"".join(
        ServerSentEvent(json.dumps(data, ensure_ascii=False), event=name).encode()
        for name, data in items
    )
