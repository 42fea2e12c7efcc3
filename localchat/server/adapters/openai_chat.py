"""OpenAI's chat and text completions (and llama-server's extras on them): requests checked
field by field into a ``GenerationRequest`` — every field either honoured or refused by
name — and the replies back through ``openai_bodies``. ``n`` replies share the prompt's
evaluation (the others copy its cells)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localchat.backends.base import Sampling
from localchat.chat.images import Joined, joined_parts
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolSpec, ToolUse
from localchat.server.adapters.openai_bodies import ChunkStream, completion_body
from localchat.server.images import ImageIntake, image_parts_refused, with_images
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
from localchat.server.tool_api import ToolRequestError, parse_tools, tool_message
from localchat.server.turns import start_choices, stream_choices, whole_reply
from localchat.server.wire import Endpoint, read_json

ROLES = ("system", "user", "assistant", "tool")
PING_S = 15


def error_body(error: ApiError) -> dict[str, Any]:
    return error.body()


def _content(content: Any, where: str, images: ImageIntake) -> Joined:
    """A message's content: a string, or OpenAI's list of parts (text, and ``image_url``
    parts with a data URI); its text, its images' (placeholder) keys and where they go."""
    if isinstance(content, str):
        return content, (), ()
    if isinstance(content, list):
        parts: list[tuple[str, str]] = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(("text", str(part.get("text", ""))))
            elif kind == "image_url":
                at = f"{where}.content[{index}].image_url"
                url = part.get("image_url")
                parts.append(
                    ("image", images.url(url.get("url") if isinstance(url, dict) else url, at))
                )
            else:
                raise bad(f"{where}.content[{index}]: only text and image_url content parts are"
                          " supported", "invalid_type")  # fmt: skip
        return joined_parts(parts)
    if content is None:
        return "", (), ()
    raise bad(f"{where}.content must be a string or a list of content parts", "invalid_type")


def _messages(body: dict[str, Any], images: ImageIntake) -> list[ChatMessage]:
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
        content, keys, image_at = _content(item.get("content"), where, images)
        if keys:
            image_parts_refused(str(role), where)
        try:
            message = tool_message(str(role), content, item, where)
        except ToolRequestError as exc:
            raise bad(str(exc), "invalid_type") from None
        messages.append(replace(message, images=keys, image_at=image_at) if keys else message)
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


# What a request may send; anything else is refused by name. Accepted as meaning nothing
# to a local model: ``user``, ``metadata``, ``store``, ``service_tier``,
# ``parallel_tool_calls``, ``reasoning_effort``, ``verbosity``, ``prompt_cache_key``,
# ``safety_identifier``, llama-server's ``cache_prompt`` (every prompt is cached here).
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty",
     "seed", "stream", "stream_options", "stop", "n", "frequency_penalty",
     "presence_penalty", "logprobs", "logit_bias", "response_format", "json_schema",
     "grammar", "user", "metadata", "cache_prompt", "service_tier", "prompt_cache_key",
     "safety_identifier", "store"}
)  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "tools", "tool_choice", "top_logprobs",
    "parallel_tool_calls", "reasoning_effort", "verbosity", "modalities",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
MAX_CHOICES = 16
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0


def _prompt(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    """A text completion's prompt: a string, or token ids (one prompt only)."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        return raw, None
    if (
        isinstance(raw, list)
        and raw
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw)
    ):
        return None, tuple(raw)
    raise bad("prompt must be a string or a list of token ids (one prompt per request)",
              "invalid_type")  # fmt: skip


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad("logit_bias must be an object of token id: bias", "invalid_type")
    biases = []
    for key, value in raw.items():
        if not str(key).isdigit():
            raise bad(f"logit_bias: {key!r} is not a token id (see POST /tokenize)")
        bias = number({"bias": value}, "bias", 0.0, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        biases.append((int(key), bias))
    return tuple(biases)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs)."""
    if chat:
        if not flag(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise bad("top_logprobs needs logprobs: true")
            return None
        top = integer(body, "top_logprobs", 0)
    else:
        top = integer(body, "logprobs", 0)
        if top is None:
            return None
    if top is not None and top > MAX_LOGPROBS:
        raise bad(f"{'top_logprobs' if chat else 'logprobs'} must be at most {MAX_LOGPROBS}")
    return top or 0


def _completion_only(body: dict[str, Any]) -> None:
    """The legacy completion's fields this server does not write: refused where set."""
    if flag(body, "echo"):
        raise bad("echo: the prompt is not written back here; prepend it yourself")
    if text_field(body, "suffix"):
        raise bad("suffix: fill-in-the-middle is not supported here")
    if (integer(body, "best_of", 1) or 1) > 1:
        raise bad("best_of: only 1 here; ask for n replies and choose")


def parse_request(body: Any, chat: bool) -> GenerationRequest:
    """A chat or text completion request, checked; ``ApiError`` names what is wrong."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    only_known(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "OpenAI's API")
    n = integer(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise bad(f"n must be at most {MAX_CHOICES}")
    tools: tuple[ToolSpec, ...] = ()
    tool_choice = "auto"
    prompt, ids = None, None
    images = ImageIntake()
    if chat:
        messages: list[ChatMessage] | None = _messages(body, images)
        if body.get("modalities") not in (None, ["text"]):
            raise bad("modalities: this server writes text only")
        try:
            tools, tool_choice = parse_tools(body)
        except ToolRequestError as exc:
            raise bad(str(exc)) from None
    else:
        _completion_only(body)
        messages = None
        prompt, ids = _prompt(body)
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
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise bad("grammar must be GBNF text", "invalid_type")
    return GenerationRequest(
        text_field(body, "model"), messages, prompt, sampling, max_tokens,
        strings(body.get("stop"), "stop"), flag(body, "stream"),
        bool(options.get("include_usage", False)),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        tool_use=ToolUse(tools, tool_choice), output_schema=_output_schema(body),
        prompt_ids=ids, logit_bias=_logit_bias(body), logprobs=_logprobs(body, chat),
        grammar=grammar or None, n=n, endpoint="chat" if chat else "completions",
        sent_images=tuple(images.sent),
    )  # fmt: skip


def _output_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """``response_format``, or llama-server's ``json_schema`` field."""
    given = body.get("json_schema")
    if given is not None:
        if not isinstance(given, dict):
            raise bad("json_schema must be a JSON schema object", "invalid_type")
        return given
    return format_schema(body.get("response_format"), "response_format")


async def respond(models: Router, request: GenerationRequest, http: Request) -> Response:
    """Admit, tokenize (a prompt the context cannot hold is refused before any stream
    starts), then stream the replies or return them whole."""
    turns = await start_choices(models, request, request.n)
    request = turns[0].request
    if request.stream:
        stream = ChunkStream(request, len(turns))
        return EventSourceResponse(stream_choices(turns, stream.head(), stream.write), ping=PING_S)
    replies = await asyncio.gather(*(whole_reply(turn, http) for turn in turns))
    return JSONResponse(completion_body(request, list(replies)))


def routes(models: Router) -> list[Endpoint]:
    async def chat(request: Request) -> Response:
        parsed = await with_images(parse_request(await read_json(request), chat=True))
        return await respond(models, parsed, request)

    async def complete(request: Request) -> Response:
        parsed = parse_request(await read_json(request), chat=False)
        return await respond(models, parsed, request)

    return [Endpoint("/chat/completions", chat), Endpoint("/completions", complete)]
