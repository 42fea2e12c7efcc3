"""What every wire API's adapter shares on the HTTP side: the request body read as JSON
(bounded), and the routes an adapter offers (the app guards each and writes its errors in
that API's shape)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from localchat.server.requests import ApiError

# A long conversation with files fits, and an image as large as one may be (20 MiB, 27 MiB
# in base64) with it; more is refused.
MAX_BODY_BYTES = 32 * 2**20
PARSED_APART_BYTES = 2**20  # a body this large is parsed on a worker thread, not the loop
DRAIN_LIMIT_BYTES = 64 * 2**20
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Endpoint:
    """One route of an adapter: its path (without ``/v1``, which ``versioned`` adds),
    handler and methods."""

    path: str
    handler: Handler
    methods: tuple[str, ...] = ("POST",)
    versioned: bool = True  # also under /v1 (clients are given a base URL with or without)


async def read_json(request: Request) -> Any:
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
        raise ApiError(
            413,
            f"the body is over {MAX_BODY_BYTES // 2**20} MiB (images count in it: send them"
            " smaller)",
            code="too_large",
        )
    try:
        if size > PARSED_APART_BYTES:  # tens of megabytes of images: other streams go on
            return await run_in_threadpool(json.loads, raw)
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})", code="invalid_json") from None


def nanoseconds(seconds: float) -> int:
    """Ollama's durations are whole nanoseconds."""
    return int(seconds * 1e9)
