"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): what coding
agents speak when given a base URL. The request's system prompt, content blocks (text,
``tool_use``, ``tool_result``, earlier ``thinking``) and tools become one
``GenerationRequest``; the reply's events come back as Anthropic's content blocks —
``thinking``, ``text``, ``tool_use`` — or its event stream (``message_start`` …
``message_stop``, ``ping`` while a long prompt is read). ``usage`` says what the cache
supplied (``cache_read_input_tokens``) apart from what was read (``input_tokens``), as
Anthropic counts them. Errors take Anthropic's shape."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localchat.backends.base import Sampling
from localchat.chat.images import joined_parts
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolSpec, ToolUse
from localchat.server.adapters.sse import sse_json
from localchat.server.events import Called, Event, Failed, Finished, Reasoning, Text
from localchat.server.images import ImageIntake, with_images
from localchat.server.requests import (
    ApiError,
    GenerationRequest,
    bad,
    flag,
    integer,
    new_seed,
    number,
    only_known,
    strings,
    text_field,
)
from localchat.server.router import Router
from localchat.server.tool_api import TOOL_NAME
from localchat.server.turns import Turn, failure, start_turn, stream_bytes, whole_reply
from localchat.server.wire import Endpoint, read_json

API = "Anthropic's Messages API"
# What a request may send. Its own settings: the conversation, the tools, the reply's
# length, stop strings, sampling (``temperature``, ``top_p``, ``top_k``: older SDKs send
# them, newer ones through ``extra_body``) and ``output_config`` (a format for the reply).
# Accepted as meaning nothing to a local model: ``metadata``, ``service_tier``, ``speed``,
# ``inference_geo``, ``user_profile_id``, ``workspace_id``, ``diagnostics``, and
# ``cache_control`` (this server caches every prompt). ``thinking`` is the model's own: a
# reasoning model thinks, another cannot.
MESSAGE_FIELDS = frozenset(
    {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
     "top_p", "top_k", "tools", "tool_choice", "output_config", "thinking", "metadata",
     "service_tier", "speed", "inference_geo", "user_profile_id", "workspace_id",
     "diagnostics", "cache_control"}
)  # fmt: skip
COUNT_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
     "cache_control"}
)  # fmt: skip
PING_S = 5  # a ping event this often while nothing else is sent (a long prompt being read)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "context": "max_tokens",
    "tool_calls": "tool_use",
    "cancelled": "end_turn",
}
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# Claude Code stamps its system prompt with a hash that changes on every request
# ("x-anthropic-billing-header: …; cch=a5145;"): the prompt's head, and so its cache, would
# never match. The stamp is made constant, as llama-server does (ggml-org/llama.cpp#21793).
BILLING_STAMP = re.compile(r"^(x-anthropic-billing-header:[^\n]*?cch=)[0-9a-f]{5};")


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape; a prompt past the context says so in the words agents look
    for to compact their history ("prompt is too long")."""
    message = str(error)
    if error.code == "context_length_exceeded" and message.startswith("the prompt is"):
        message = f"prompt is too long: {message}"
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks", "invalid_type")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}.content[{index}] must be a block with a type", "invalid_type")
    return content


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text must be a string", "invalid_type")
    return text


def _unsupported(kind: str, where: str) -> ApiError:
    if kind == "document":
        return bad(f"{where}: document blocks are not read here: send the text instead",
                   "unsupported_content")  # fmt: skip
    if kind == "image":
        return bad(f"{where}: an image goes in a user message or a tool_result, not here",
                   "unsupported_content")  # fmt: skip
    return bad(f"{where}: block type {kind!r} is not one this server takes (text, image,"
               " tool_use, tool_result, thinking)", "invalid_type")  # fmt: skip


def _image(block: dict[str, Any], where: str, images: ImageIntake) -> str:
    """An image block's (placeholder) key: its ``source`` base64 (a URL is refused)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        return images.base64(source.get("data"), f"{where}.source.data")
    if kind == "url":
        raise bad(f"{where}.source: this server does not fetch images from URLs; send the"
                  " image itself as a base64 source", "unsupported_content")  # fmt: skip
    raise bad(f"{where}.source must be {{type: base64, media_type, data}}", "invalid_type")


def _system(value: Any) -> list[ChatMessage]:
    if value is None:
        return []
    if isinstance(value, str):
        text = value
    else:
        parts = []
        for index, block in enumerate(_blocks(value, "system")):
            if block["type"] != "text":
                raise bad(f"system[{index}] must be a text block, not {block['type']!r}")
            parts.append(_text_of(block, f"system[{index}]"))
        text = "".join(parts)  # as llama-server joins them: the same prompt from either
    text = BILLING_STAMP.sub(r"\1fffff;", text)
    return [ChatMessage("system", text)] if text else []


def _tool_result(block: dict[str, Any], where: str, images: ImageIntake) -> ChatMessage:
    """A tool's result: its text blocks run together, as llama-server runs them; with an
    image (a screenshot, a file the tool read), joined around it as a user's parts are."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.tool_use_id must name the tool_use it answers")
    parts: list[tuple[str, str]] = []
    for index, part in enumerate(_blocks(block.get("content") or [], where)):
        at = f"{where}.content[{index}]"
        if part["type"] == "text":
            parts.append(("text", _text_of(part, at)))
        elif part["type"] == "image":
            parts.append(("image", _image(part, at, images)))
        else:
            raise _unsupported(part["type"], at)
    if any(kind == "image" for kind, _ in parts):
        text, keys, image_at = joined_parts(parts)
    else:
        text, keys, image_at = "".join(value for _, value in parts), (), ()
    if block.get("is_error") is True:
        text, image_at = f"Error: {text}", tuple(offset + len("Error: ") for offset in image_at)
    return ChatMessage("tool", text, tool_call_id=call_id, images=keys, image_at=image_at)


def _message(item: Any, where: str, images: ImageIntake) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user's tool results become tool messages
    (before any text of the same message), an assistant's tool_use blocks its calls."""
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object with role and content", "invalid_type")
    role = item.get("role")
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role must be user or assistant, not {role!r}")
    parts: list[tuple[str, str]] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for index, block in enumerate(_blocks(item.get("content"), where)):
        at, kind = f"{where}.content[{index}]", block["type"]
        if kind == "text":
            parts.append(("text", _text_of(block, at)))
        elif kind == "image" and role == "user":
            parts.append(("image", _image(block, at, images)))
        elif kind == "tool_use" and role == "assistant":
            name, arguments, call_id = block.get("name"), block.get("input", {}), block.get("id")
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise bad(f"{at} must have a name and an input object", "invalid_type")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{at}.id must be a string that its tool_result names")
            calls.append(ToolCall(name, arguments, call_id))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at, images))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # templates drop earlier turns' reasoning: the prompt is the same
        elif kind in ("tool_use", "tool_result"):
            raise bad(f"{at}: a {kind} block belongs in an "
                      f"{'assistant' if kind == 'tool_use' else 'user'} message")  # fmt: skip
        else:
            raise _unsupported(kind, at)
    text, keys, image_at = joined_parts(parts)
    if role == "user":
        said = ChatMessage("user", text, images=keys, image_at=image_at)
        return [*results, said] if text or keys or not results else results
    return [ChatMessage("assistant", text, tool_calls=tuple(calls))]


def _tools(body: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], str]:
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise bad("tools must be a list of {name, description, input_schema}", "invalid_type")
    tools = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise bad(f"{where} must be an object", "invalid_type")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(f"{where}: {kind!r} is a tool Anthropic's servers run; this server"
                      " offers the model your own tools only (name, input_schema)")  # fmt: skip
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.name must be 1 to 64 letters, digits, _ . -, not {name!r}")
        if not isinstance(schema, dict):
            raise bad(f"{where}.input_schema must be a JSON schema object", "invalid_type")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise bad(f"{where}.description must be a string", "invalid_type")
        tools.append(ToolSpec(name, description, schema))
    return tuple(tools), _tool_choice(body.get("tool_choice"), {t.name for t in tools})


def _tool_choice(choice: Any, names: set[str]) -> str:
    """Anthropic's tool_choice as the runtime's: auto, none, required (any) or a name."""
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICE_TYPES:
        raise bad(f"tool_choice.type must be one of {', '.join(TOOL_CHOICE_TYPES)}, not {kind!r}")
    assert isinstance(choice, dict)
    if kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise bad(f"tool_choice names {name!r}, which is not among the tools offered")
        return str(name)
    if kind == "any":
        if not names:
            raise bad("tool_choice any needs tools to call")
        return "required"
    return str(kind)


def _conversation(
    body: dict[str, Any], images: ImageIntake
) -> tuple[list[ChatMessage], tuple[ToolSpec, ...], str]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list of {role, content}", "invalid_type")
    messages = _system(body.get("system"))
    for index, item in enumerate(raw):
        messages += _message(item, f"messages[{index}]", images)
    tools, choice = _tools(body)
    thinking = body.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict) and isinstance(thinking.get("type"), str)
    ):
        raise bad("thinking must be an object with a type (enabled, adaptive, …)", "invalid_type")
    return messages, tools, choice


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _output_schema(config: Any) -> dict[str, Any] | None:
    """``output_config``: its ``format`` (a JSON schema the reply follows, held by a
    grammar); its ``effort``, accepted (a local model's effort is its own)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("output_config must be an object", "invalid_type")
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise bad(f"output_config.{unknown[0]}: not a setting this server takes (format, effort)")
    if config.get("effort") not in (None, *EFFORTS):
        raise bad(f"output_config.effort must be one of {', '.join(EFFORTS)}")
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise bad("output_config.format must be {type: json_schema, schema: {…}}")
    schema = form.get("schema")
    if not isinstance(schema, dict):
        raise bad("output_config.format.schema must be a JSON schema object", "invalid_type")
    return schema


def parse_request(body: Any) -> GenerationRequest:
    """A Messages request, checked; ``ApiError`` names what is wrong."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    only_known(body, MESSAGE_FIELDS, API)
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad("max_tokens is required: the most tokens the reply may have", "missing_field")
    images = ImageIntake()
    messages, tools, choice = _conversation(body, images)
    top_k = integer(body, "top_k", 0)
    sampling = Sampling(
        temperature=number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=40 if top_k is None else top_k,
        min_p=0.0,  # Anthropic's sampling has none
        seed=new_seed(None),
    )
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata must be an object", "invalid_type")
    return GenerationRequest(
        text_field(body, "model"),
        messages,
        None,
        sampling,
        max_tokens,
        strings(body.get("stop_sequences"), "stop_sequences"),
        flag(body, "stream"),
        tool_use=ToolUse(tools, choice),
        output_schema=_output_schema(body.get("output_config")),
        endpoint="messages",
        request_id=f"msg_{uuid.uuid4().hex[:24]}",
        sent_images=tuple(images.sent),
    )


def parse_count(body: Any) -> GenerationRequest:
    """A count_tokens request: the prompt's parts only."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    only_known(body, COUNT_FIELDS, API)
    images = ImageIntake()
    messages, tools, choice = _conversation(body, images)
    return GenerationRequest(
        text_field(body, "model"), messages, None, Sampling(), None,
        tool_use=ToolUse(tools, choice), endpoint="count_tokens", sent_images=tuple(images.sent),
    )  # fmt: skip


def _usage(finished: Finished) -> dict[str, int]:
    cached = finished.cached_tokens
    return {
        "input_tokens": finished.stats.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": finished.stats.generated_tokens,
    }


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def message_body(request: GenerationRequest, reply_text: str, reasoning: str,
                 calls: tuple[ToolCall, ...], finished: Finished) -> dict[str, Any]:  # fmt: skip
    """The whole reply as one Message."""
    content: list[dict[str, Any]] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if reply_text:
        content.append({"type": "text", "text": reply_text})
    content += [_tool_block(call) for call in calls]
    return {
        "id": request.request_id,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": STOP_REASONS[finished.reason],
        "stop_sequence": finished.stop_sequence,
        "usage": _usage(finished),
    }


class _Stream:
    """The reply's events as Anthropic's event stream: a content block opened for each
    kind of piece as it comes (thinking, then text), a ``tool_use`` block for each call at
    the end, each closed before the next opens."""

    def __init__(self, turn: Turn) -> None:
        self.request = turn.request
        self.turn = turn
        self.index = -1
        self.open: str | None = None  # the kind of the block open now

    def head(self) -> bytes:
        job = self.turn.job
        cached = job.expected_cached if job is not None else 0
        message: dict[str, Any] = {
            "id": self.request.request_id, "type": "message", "role": "assistant",
            "model": self.request.model, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.turn.prompt_tokens - cached,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                      "output_tokens": 0},
        }  # fmt: skip
        return sse_json([("message_start", {"type": "message_start", "message": message})])

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # Anthropic's clients expect a signature (none here)
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [
            *events,
            ("content_block_stop", {"type": "content_block_stop", "index": self.index}),
        ]

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                       "delta": delta}  # fmt: skip

    def write(self, batch: list[Event]) -> bytes:
        events: list[tuple[str, dict[str, Any]]] = []
        for event in batch:
            if isinstance(event, Reasoning):
                if self.open != "thinking":
                    events += self._start({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, Text):
                if self.open != "text":
                    events += self._start({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, Called):
                for call in event.calls:
                    events += self._start({**_tool_block(call), "input": {}})
                    arguments = json.dumps(call.arguments, ensure_ascii=False)
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": arguments}))  # fmt: skip
            elif isinstance(event, Finished):
                delta = {"stop_reason": STOP_REASONS[event.reason],
                         "stop_sequence": event.stop_sequence}  # fmt: skip
                events += [
                    *self._close(),
                    ("message_delta", {"type": "message_delta", "delta": delta,
                                       "usage": _usage(event)}),
                    ("message_stop", {"type": "message_stop"}),
                ]  # fmt: skip
            elif isinstance(event, Failed):
                events.append(("error", error_body(failure(event.error))))
        return sse_json(events)


def _ping() -> ServerSentEvent:
    return ServerSentEvent(json.dumps({"type": "ping"}), event="ping")


async def respond(models: Router, request: GenerationRequest, http: Request) -> Response:
    """Admit, tokenize (a prompt past the context is refused before any stream starts),
    then stream the reply or return it whole."""
    turn = await start_turn(models, request)
    if turn.request.stream:
        stream = _Stream(turn)
        return EventSourceResponse(
            stream_bytes(turn, stream.head(), stream.write),
            ping=PING_S,
            ping_message_factory=_ping,
        )
    reply = await whole_reply(turn, http)
    body = message_body(turn.request, reply.text, reply.reasoning, reply.calls, reply.finished)
    return JSONResponse(body)


async def count_tokens(models: Router, request: GenerationRequest) -> Response:
    """``{"input_tokens": N}``: the prompt as this model reads it (not behind a running
    reply: the template and the tokenizer run on a worker thread)."""
    async with models.hold(request.model) as runner:
        prompt = await run_in_threadpool(runner.prompt_ids, request)
    return JSONResponse({"input_tokens": len(prompt)})


def routes(models: Router) -> list[Endpoint]:
    async def messages(request: Request) -> Response:
        parsed = await with_images(parse_request(await read_json(request)))
        return await respond(models, parsed, request)

    async def counted(request: Request) -> Response:
        return await count_tokens(models, await with_images(parse_count(await read_json(request))))

    return [Endpoint("/messages", messages), Endpoint("/messages/count_tokens", counted)]
