"""The one request every wire API becomes (``GenerationRequest``), the refusal every API
shapes its own way (``ApiError``), and the field checks the adapters share: a field of
the wrong type or out of range is a 400 that names it, and ``null`` means the default."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from localchat.backends.base import Sampling
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolUse

DEFAULT_MAX_TOKENS = 512


class ApiError(Exception):
    """A request refused: HTTP ``status``, the message, OpenAI's error ``type`` and ``code``
    (each adapter writes them in its API's error shape)."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error body (also llama-server's)."""
        return {"error": {"message": str(self), "type": self.kind, "code": self.code or None}}


def bad(message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for a field: ``message`` names it and says what is wrong."""
    return ApiError(400, message, code=code)


@dataclass(frozen=True)
class SentImage:
    """An image as a request sent it: its base64 text and the field it came in (stored by
    ``images.with_images``)."""

    data: str
    where: str


@dataclass(frozen=True)
class GenerationRequest:
    """A chat (``messages``) or text (``prompt``) completion asked for, by any API."""

    model: str
    messages: list[ChatMessage] | None  # a chat completion
    prompt: str | None  # a text completion (no template)
    sampling: Sampling
    max_tokens: int | None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token already came
    presence_penalty: float = 0.0  # OpenAI's: subtracted once a token came at all
    # The tools rendered in the prompt (under "none" too: the prompt's head, and its cache,
    # stays the same) and how the reply may use them.
    tool_use: ToolUse = field(default_factory=ToolUse)
    context_limit: int | None = None  # a client's own cap on prompt and reply (num_ctx)
    prompt_ids: tuple[int, ...] | None = None  # a text completion's prompt given as token ids
    logit_bias: tuple[tuple[int, float], ...] = ()  # added to those tokens' logits
    logprobs: int | None = None  # None: none; else each token's and this many alternatives'
    grammar: str | None = None  # GBNF the reply follows (llama-server's ``grammar``)
    n: int = 1  # replies to write (they share the prompt's evaluation)
    # Structured output: the reply is one JSON value after this schema (a grammar holds it).
    output_schema: dict[str, Any] | None = None
    endpoint: str = "chat"  # which API asked (the request log says so)
    # How long the model stays loaded once idle (Ollama's ``keep_alive``; -1: for good;
    # None: the server's own).
    keep_alive_s: float | None = None
    # The images the messages hold as placeholders until ``images.with_images`` stores them.
    sent_images: tuple[SentImage, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")


def number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A number field in ``[low, high]`` (``default`` where absent or null)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"{name} must be a number, not {value!r}", "invalid_type")
    if not low <= value <= high:
        raise bad(f"{name} must be between {low:g} and {high:g}, not {value!r}")
    return float(value)


def integer(body: dict[str, Any], name: str, low: int) -> int | None:
    """An integer field of at least ``low`` (None where absent or null)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, not {value!r}", "invalid_type")
    if value < low:
        raise bad(f"{name} must be at least {low}, not {value}")
    return value


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A true/false field (``default`` where absent or null)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, not {value!r}", "invalid_type")
    return value


def text_field(body: dict[str, Any], name: str, default: str = "") -> str:
    """A string field (``default`` where absent or null)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, not {value!r}", "invalid_type")
    return value


def strings(value: Any, name: str) -> tuple[str, ...]:
    """A string or a list of strings (stop strings); empty ones dropped."""
    if value is None:
        return ()
    found = [value] if isinstance(value, str) else value
    if not isinstance(found, list) or not all(isinstance(s, str) for s in found):
        raise bad(f"{name} must be a string or a list of strings", "invalid_type")
    return tuple(s for s in found if s)


def new_seed(given: int | None) -> int:
    """The sampler's seed: the one given, else (none, or llama-server's -1) a new one."""
    return given if given is not None and given >= 0 else random.randrange(2**31)


def only_known(body: dict[str, Any], known: frozenset[str], api: str) -> None:
    """Refuse a field this server would not honour, naming it (a client must not believe a
    setting took effect that was silently dropped)."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(
            f"{', '.join(unknown)}: not a field {api} takes here (this server knows"
            f" {', '.join(sorted(known))})",
            "unknown_parameter",
        )
