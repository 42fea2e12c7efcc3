"""OpenAI's chat and text completions (and llama-server's extras on them): requests checked
field by field into a ``GenerationRequest``, and the reply's events back as OpenAI's bodies
and stream chunks, with usage (``cached_tokens``) and llama-server's ``timings``."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localchat.backends.base import Sampling, TurnStats
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolSpec, ToolUse
from localchat.server.adapters.sse import sse
from localchat.server.events import Called, Event, Failed, Finished, Reasoning, Text
from localchat.server.requests import (
    ApiError,
    GenerationRequest,
    bad,
    flag,
    integer,
    new_seed,
    number,
    strings,
    text_field,
)
from localchat.server.runner import ModelRunner
from localchat.server.tool_api import ToolRequestError, openai_calls, parse_tools, tool_message
from localchat.server.turns import Turn, failure, start_turn, stream_bytes, whole_reply
from localchat.server.wire import Endpoint, read_json

ROLES = ("system", "user", "assistant", "tool")
MAX_STOPS = 4  # OpenAI's limit
PING_S = 15


def error_body(error: ApiError) -> dict[str, Any]:
    return error.body()


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text content parts are supported", "invalid_type")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise bad(f"{where}.content must be a string or a list of text parts", "invalid_type")


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list of {role, content}", "invalid_type")
    messages = []
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object with role and content", "invalid_type")
        role = "system" if item.get("role") == "developer" else item.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}")
        content = _text_content(item.get("content"), where)
        try:
            messages.append(tool_message(str(role), content, item, where))
        except ToolRequestError as exc:
            raise bad(str(exc), "invalid_type") from None
    return messages


def format_schema(value: Any, name: str) -> dict[str, Any] | None:
    """The JSON schema a reply must follow, from OpenAI's ``response_format`` (``text``,
    ``json_object``, ``json_schema`` with its ``schema``; llama-server's ``schema`` inside a
    ``json_object`` too) or the Responses API's flat ``text.format``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    assert kind is None or isinstance(value, dict)
    if kind == "json_object":
        schema = value.get("schema") or {"type": "object"}
    elif kind == "json_schema":
        inner = value.get("json_schema", value)  # chat nests it; Responses does not
        schema = inner.get("schema") if isinstance(inner, dict) else None
    else:
        raise bad(f"{name}.type must be text, json_object or json_schema, not {kind!r}")
    if not isinstance(schema, dict):
        raise bad(f"{name}: json_schema needs a schema object", "invalid_type")
    return schema


def parse_request(body: Any, chat: bool) -> GenerationRequest:
    """A chat or text completion request, checked; ``ApiError`` names what is wrong."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    n = integer(body, "n", 1)
    if n is not None and n != 1:
        raise bad("n must be 1: this server writes one choice per request")
    tools: tuple[ToolSpec, ...] = ()
    tool_choice = "auto"
    if chat:
        messages, prompt = _messages(body), None
        try:
            tools, tool_choice = parse_tools(body)
        except ToolRequestError as exc:
            raise bad(str(exc)) from None
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if not isinstance(raw, str):
            raise bad("prompt must be a string", "invalid_type")
        messages, prompt = None, raw
    max_tokens = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
    sampling = Sampling(
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(number(body, "top_k", 40, 0, 1_000_000)),
        min_p=number(body, "min_p", 0.05, 0.0, 1.0),
        repeat_penalty=number(body, "repeat_penalty", 1.0, 0.0, 10.0),
        seed=new_seed(integer(body, "seed", -1)),  # -1 (llama-server) or none: a new one
    )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "invalid_type")
    stops = strings(body.get("stop"), "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop takes at most {MAX_STOPS} strings, not {len(stops)}")
    return GenerationRequest(
        text_field(body, "model"),
        messages,
        prompt,
        sampling,
        max_tokens,
        stops,
        flag(body, "stream"),
        bool(options.get("include_usage", False)),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        tool_use=ToolUse(tools, tool_choice),
        output_schema=_output_schema(body),
        endpoint="chat" if chat else "completions",
    )


def _output_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """``response_format``, or llama-server's ``json_schema`` field."""
    given = body.get("json_schema")
    if given is not None:
        if not isinstance(given, dict):
            raise bad("json_schema must be a JSON schema object", "invalid_type")
        return given
    return format_schema(body.get("response_format"), "response_format")


FINISH_REASONS = {"stop_sequence": "stop", "context": "length", "cancelled": "stop"}


def finish_reason(finished: Finished) -> str:
    return FINISH_REASONS.get(finished.reason, finished.reason)


def usage(finished: Finished) -> dict[str, Any]:
    """OpenAI's usage: ``cached_tokens`` are prompt tokens not evaluated (held in memory or
    restored from disk)."""
    stats = finished.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
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
    finished: Finished,
    calls: tuple[ToolCall, ...] = (),
) -> dict[str, Any]:
    """The whole reply, unstreamed (with the tools it calls)."""
    reason = finish_reason(finished)
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
        "usage": usage(finished),
        "timings": timings(finished.stats),
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
    request: GenerationRequest, finished: Finished, calls: tuple[ToolCall, ...] = ()
) -> list[dict[str, Any]]:
    """The calls the reply made (one delta), the chunk that says why the reply ended, and
    the usage chunk where it was asked for."""
    chunks = []
    if calls:
        called = delta_chunk(request)
        called["choices"][0]["delta"]["tool_calls"] = openai_calls(calls)
        chunks.append(called)
    last = delta_chunk(request)
    last["choices"][0]["finish_reason"] = finish_reason(finished)
    last["timings"] = timings(finished.stats)
    chunks.append(last)
    if request.include_usage:
        chunks.append({**_envelope(request, chunk=True), "choices": [], "usage": usage(finished)})
    return chunks


class _Stream:
    """The reply's events as OpenAI's SSE chunks, ending with ``data: [DONE]``."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.calls: tuple[ToolCall, ...] = ()

    def head(self) -> bytes:
        return sse([json.dumps(delta_chunk(self.request, first=True))])

    def write(self, batch: list[Event]) -> bytes:
        data: list[str] = []
        for event in batch:
            if isinstance(event, Text | Reasoning):
                reasoning = isinstance(event, Reasoning)
                data.append(json.dumps(delta_chunk(self.request, event.text, reasoning)))
            elif isinstance(event, Called):
                self.calls = event.calls
            elif isinstance(event, Finished):
                chunks = final_chunks(self.request, event, self.calls)
                data += [*(json.dumps(chunk) for chunk in chunks), "[DONE]"]
            elif isinstance(event, Failed):
                data.append(json.dumps(failure(event.error).body()))
        return sse(data)


async def respond(runner: ModelRunner, request: GenerationRequest, http: Request) -> Response:
    """Admit, tokenize (a prompt the context cannot hold is refused before any stream
    starts), then stream the reply or return it whole."""
    turn: Turn = await start_turn(runner, request)
    request = turn.request
    if request.stream:
        stream = _Stream(request)
        return EventSourceResponse(stream_bytes(turn, stream.head(), stream.write), ping=PING_S)
    reply = await whole_reply(turn, http)
    body = completion_body(request, reply.text, reply.reasoning, reply.finished, reply.calls)
    return JSONResponse(body)


def routes(runner: ModelRunner) -> list[Endpoint]:
    async def chat(request: Request) -> Response:
        parsed = parse_request(await read_json(request), chat=True)
        return await respond(runner, parsed, request)

    async def complete(request: Request) -> Response:
        parsed = parse_request(await read_json(request), chat=False)
        return await respond(runner, parsed, request)

    return [Endpoint("/chat/completions", chat), Endpoint("/completions", complete)]
