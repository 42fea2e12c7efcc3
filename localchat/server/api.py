"""What OpenAI-compatible clients send and get back: requests checked field by field into
dataclasses, and the response bodies (chat and text completions, their stream chunks,
usage with ``cached_tokens``, llama-server's ``timings``, OpenAI-shaped errors).

A request that cannot be served is an ``ApiError``: the status and the one line that names
the field and what is wrong, in the body OpenAI's clients parse."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from localchat.backends.base import Sampling, TurnStats
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolSpec, ToolUse
from localchat.server.tool_api import ToolRequestError, openai_calls, parse_tools, tool_message

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 512
MAX_STOPS = 4  # OpenAI's limit


class ApiError(Exception):
    """A request refused: HTTP ``status``, the message, OpenAI's error ``type`` and ``code``."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code or None}}


def _bad(message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code)


@dataclass(frozen=True)
class GenerationRequest:
    """A chat (``messages``) or text (``prompt``) completion asked for."""

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
    created: int = field(default_factory=lambda: int(time.time()))
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{name} must be a number, not {value!r}", "invalid_type")
    if not low <= value <= high:
        raise _bad(f"{name} must be between {low:g} and {high:g}, not {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, not {value!r}", "invalid_type")
    if value < low:
        raise _bad(f"{name} must be at least {low}, not {value}")
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"{where}: only text content parts are supported", "invalid_type")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise _bad(f"{where}.content must be a string or a list of text parts", "invalid_type")


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list of {role, content}", "invalid_type")
    messages = []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object with role and content", "invalid_type")
        role = "system" if item.get("role") == "developer" else item.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}")
        content = _text_content(item.get("content"), where)
        try:
            messages.append(tool_message(str(role), content, item, where))
        except ToolRequestError as exc:
            raise _bad(str(exc), "invalid_type") from None
    return messages


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise _bad(f"stop takes at most {MAX_STOPS} strings, not {len(stops)}")
    return tuple(s for s in stops if s)


def parse_request(body: Any, chat: bool) -> GenerationRequest:
    """A chat or text completion request, checked; ``ApiError`` names what is wrong."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", "invalid_type")
    n = _integer(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("n must be 1: this server writes one choice per request")
    tools: tuple[ToolSpec, ...] = ()
    tool_choice = "auto"
    if chat:
        messages, prompt = _messages(body), None
        try:
            tools, tool_choice = parse_tools(body)
        except ToolRequestError as exc:
            raise _bad(str(exc)) from None
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if not isinstance(raw, str):
            raise _bad("prompt must be a string", "invalid_type")
        messages, prompt = None, raw
    max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    seed = _integer(body, "seed", -1)  # -1 (llama-server) or none: a new one each time
    sampling = Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(_number(body, "top_k", 40, 0, 1_000_000)),
        min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 10.0),
        seed=seed if seed is not None and seed >= 0 else random.randrange(2**31),
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "invalid_type")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _bad("model must be a string", "invalid_type")
    return GenerationRequest(
        model,
        messages,
        prompt,
        sampling,
        max_tokens,
        _stops(body),
        stream,
        bool(options.get("include_usage", False)),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        tool_use=ToolUse(tools, tool_choice),
    )


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def finish_reason(stats: TurnStats) -> str:
    return FINISH_REASONS.get(stats.stop_reason, "stop")


def usage(stats: TurnStats) -> dict[str, Any]:
    """OpenAI's usage: ``cached_tokens`` are prompt tokens not evaluated (held in memory or
    restored from disk); llama-server's ``timings`` beside it."""
    cached = max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated)
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings(stats: TurnStats) -> dict[str, Any]:
    """llama-server's per-request timings (and its draft counts)."""
    predicted_s = stats.generated_tokens / stats.gen_tps if stats.gen_tps else 0.0
    return {
        "cache_n": max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated),
        "prompt_n": stats.prompt_tokens_evaluated,
        "prompt_ms": round(stats.ttft_s * 1000, 3),
        "prompt_per_second": round(stats.prompt_tps, 3),
        "predicted_n": stats.generated_tokens,
        "predicted_ms": round(predicted_s * 1000, 3),
        "predicted_per_second": round(stats.gen_tps, 3),
        "draft_n": stats.drafted_tokens,
        "draft_n_accepted": stats.accepted_tokens,
    }


def _envelope(request: GenerationRequest, chunk: bool) -> dict[str, Any]:
    chat = request.messages is not None
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": request.request_id if chat else request.request_id.replace("chatcmpl", "cmpl"),
        "object": f"{kind}.chunk" if chunk and chat else kind,
        "created": request.created,
        "model": request.model,
    }


def completion_body(
    request: GenerationRequest,
    text: str,
    reasoning: str,
    stats: TurnStats,
    calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    """The whole reply, unstreamed (with the tools it calls)."""
    reason = "tool_calls" if calls else finish_reason(stats)
    if request.messages is not None:
        message: dict[str, Any] = {"role": "assistant", "content": text or None if calls else text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in openai_calls(calls)
            ]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {
        **_envelope(request, chunk=False),
        "choices": [choice],
        "usage": usage(stats),
        "timings": timings(stats),
    }


def delta_chunk(
    request: GenerationRequest, text: str = "", reasoning: bool = False, first: bool = False
) -> dict[str, Any]:
    """One streamed piece of the reply."""
    if request.messages is None:
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["reasoning_content" if reasoning else "content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": None}
    body = {**_envelope(request, chunk=True), "choices": [choice]}
    if request.include_usage:
        body["usage"] = None
    return body


def final_chunks(
    request: GenerationRequest, stats: TurnStats, calls: list[ToolCall] | None = None
) -> list[dict[str, Any]]:
    """The calls the reply made (one delta), the chunk that says why the reply ended, and
    the usage chunk where it was asked for."""
    chunks = []
    if calls:
        called = delta_chunk(request)
        called["choices"][0]["delta"]["tool_calls"] = openai_calls(calls)
        chunks.append(called)
    last = delta_chunk(request)
    last["choices"][0]["finish_reason"] = "tool_calls" if calls else finish_reason(stats)
    last["timings"] = timings(stats)
    chunks.append(last)
    if request.include_usage:
        chunks.append({**_envelope(request, chunk=True), "choices": [], "usage": usage(stats)})
    return chunks
