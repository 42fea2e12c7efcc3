"""Ollama's API on the same server: what editors, launchers and home tools speak when they
only know Ollama (``/api/chat``, ``/api/generate`` streamed as NDJSON, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version`` and the root probe). A request becomes one
``GenerationRequest``; the reply's events come back with Ollama's fields: ``message`` or
``response``, ``done``, ``done_reason`` and the durations in nanoseconds. Errors are
Ollama's ``{"error": "…"}``."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from localchat.backends.base import Sampling
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ID_ALPHABET, ID_LENGTH, ToolCall, ToolSpec, ToolUse
from localchat.errors import UsageError
from localchat.server.adapters.ollama_models import running, show, show_request, tags
from localchat.server.adapters.openai_chat import format_schema
from localchat.server.events import Called, Event, Failed, Finished, Reasoning, Text
from localchat.server.images import ImageIntake, image_parts_refused, with_images
from localchat.server.model_facts import served_model, served_models
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
from localchat.server.tool_api import ToolRequestError, parse_tools
from localchat.server.turns import failure, start_turn, stream_bytes, whole_reply
from localchat.server.wire import Endpoint, nanoseconds, read_json
from localchat.units import parse_duration

API = "Ollama's API"
# The version clients are told: some check for a minimum before they use newer fields.
OLLAMA_VERSION = "0.14.0"
CHAT_FIELDS = frozenset(
    {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"}
)
GENERATE_FIELDS = frozenset(
    {"model", "prompt", "system", "raw", "format", "options", "stream", "keep_alive", "think",
     "suffix", "template", "context", "images"}
)  # fmt: skip
# Options that say how to load a model, not what to write: a loaded model has them already.
LOAD_OPTIONS = frozenset(
    {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "use_mmap", "use_mlock",
     "num_thread", "num_keep", "vocab_only", "logits_all", "embedding_only", "f16_kv"}
)  # fmt: skip
SAMPLING_OPTIONS = frozenset(
    {"num_ctx", "num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
     "repeat_penalty", "presence_penalty", "frequency_penalty"}
)  # fmt: skip
ROLES = ("system", "user", "assistant", "tool")
DONE_REASONS = {"length": "length", "context": "length"}  # the rest: "stop"


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": str(error)}


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad("options must be an object", "invalid_type")
    unknown = sorted(set(options) - LOAD_OPTIONS - SAMPLING_OPTIONS)
    if unknown:
        raise bad(f"options.{', options.'.join(unknown)}: not honoured by this server (it"
                  f" takes {', '.join(sorted(SAMPLING_OPTIONS))})", "unknown_parameter")  # fmt: skip
    return options


def _sampling(options: dict[str, Any]) -> Sampling:
    """Ollama's defaults where a client sends none, but ``repeat_penalty`` 1.0 (as
    llama-server and the other APIs here): Ollama's 1.1 would change a greedy reply."""
    return Sampling(
        temperature=number(options, "temperature", 0.8, 0.0, 2.0),
        top_p=number(options, "top_p", 0.9, 0.0, 1.0),
        top_k=int(number(options, "top_k", 40, 0, 1_000_000)),
        min_p=number(options, "min_p", 0.0, 0.0, 1.0),
        repeat_penalty=number(options, "repeat_penalty", 1.0, 0.0, 10.0),
        seed=new_seed(integer(options, "seed", -1)),
    )


def _max_tokens(options: dict[str, Any]) -> int | None:
    """``num_predict``: -1 (or -2) for as many as the context holds."""
    limit = integer(options, "num_predict", -2)
    return None if limit is None or limit < 0 else max(limit, 1)


def _format(value: Any) -> dict[str, Any] | None:
    """``format``: "json" (any JSON object) or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "object"}
    if isinstance(value, dict):
        return format_schema({"type": "json_schema", "schema": value}, "format")
    raise bad('format must be "json" or a JSON schema object', "invalid_type")


def _think(body: dict[str, Any]) -> None:
    """``think``: accepted (a reasoning model's thinking comes apart, in ``thinking``)."""
    think = body.get("think")
    if think is not None and not isinstance(think, bool) and think not in ("low", "medium", "high"):
        raise bad('think must be true, false, "low", "medium" or "high"', "invalid_type")


def stable_call_id(index: int, name: str, arguments: dict[str, Any]) -> str:
    """An id for a call a client sent without one (Ollama's calls have none): the same call
    at the same place gets the same id, so the prompt, and its cache, stays the same."""
    seed = json.dumps([index, name, arguments], sort_keys=True).encode()
    digest = hashlib.sha256(seed).digest()
    return "".join(ID_ALPHABET[byte % len(ID_ALPHABET)] for byte in digest[:ID_LENGTH])


def _calls(item: dict[str, Any], where: str, at: int) -> tuple[ToolCall, ...]:
    raw = item.get("tool_calls") or []
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls must be a list", "invalid_type")
    calls = []
    for index, entry in enumerate(raw):
        function = entry.get("function") if isinstance(entry, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise bad(f"{where}.tool_calls[{index}].function.arguments is not JSON") from None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise bad(f"{where}.tool_calls[{index}] must be {{function: {{name, arguments}}}}")
        assert isinstance(entry, dict)
        call_id = entry.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = stable_call_id(at * 100 + index, name, arguments)
        calls.append(ToolCall(name, arguments, call_id))
    return tuple(calls)


def _images(value: Any, where: str, images: ImageIntake) -> tuple[str, ...]:
    """``images``: a list of base64 images; their (placeholder) keys."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(f"{where} must be a list of base64 images", "invalid_type")
    return tuple(images.base64(item, f"{where}[{index}]") for index, item in enumerate(value))


def _messages(body: dict[str, Any], images: ImageIntake) -> list[ChatMessage]:
    raw = body.get("messages")
    if not isinstance(raw, list):  # none at all: the model is only loaded (or unloaded)
        raise bad("messages must be a list of {role, content}", "invalid_type")
    messages: list[ChatMessage] = []
    open_calls: list[ToolCall] = []  # the last assistant's calls not yet answered
    for index, item in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object with role and content", "invalid_type")
        role = item.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}")
        content = text_field(item, "content")
        keys = _images(item.get("images"), f"{where}.images", images)
        if keys:
            image_parts_refused(str(role), where)
        if role == "tool":
            messages.append(ChatMessage("tool", content, tool_call_id=_answers(item, open_calls)))
        elif role == "assistant":
            open_calls = list(_calls(item, where, index))
            messages.append(ChatMessage("assistant", content, tool_calls=tuple(open_calls)))
        else:
            messages.append(ChatMessage(str(role), content, images=keys))
    return messages


def _answers(item: dict[str, Any], open_calls: list[ToolCall]) -> str:
    """The call a tool message answers: its ``tool_call_id``, else the first open call of
    its ``tool_name``, else the first open call."""
    given = item.get("tool_call_id")
    if isinstance(given, str) and given:
        return given
    name = item.get("tool_name")
    for call in open_calls:
        if name in (None, call.name):
            open_calls.remove(call)
            return call.id
    return stable_call_id(-1, str(name or ""), {})


def _tools(body: dict[str, Any]) -> tuple[ToolSpec, ...]:
    try:
        tools, _ = parse_tools({"tools": body.get("tools")})
    except ToolRequestError as exc:
        raise bad(str(exc)) from None
    return tools


def keep_alive(body: dict[str, Any]) -> float | None:
    """``keep_alive``: how long the model stays loaded after this request (None: the
    server's own)."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if not isinstance(value, str | int | float):
        raise bad(f"keep_alive must be a duration like \"10m\" or seconds, not {value!r}",
                  "invalid_type")  # fmt: skip
    try:
        return parse_duration(value)
    except UsageError as exc:
        raise bad(f"keep_alive: {exc}") from None


def parse_chat(body: Any) -> GenerationRequest:
    """An ``/api/chat`` request, checked; ``ApiError`` names what is wrong."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    only_known(body, CHAT_FIELDS, API)
    options = _options(body)
    _think(body)
    images = ImageIntake()
    return GenerationRequest(
        text_field(body, "model"),
        _messages(body, images),
        None,
        _sampling(options),
        _max_tokens(options),
        strings(options.get("stop"), "options.stop"),
        flag(body, "stream", default=True),
        tool_use=ToolUse(_tools(body), "auto"),
        context_limit=integer(options, "num_ctx", 1),
        output_schema=_format(body.get("format")),
        endpoint="ollama_chat",
        keep_alive_s=keep_alive(body),
        sent_images=tuple(images.sent),
    )


def parse_generate(body: Any) -> GenerationRequest:
    """An ``/api/generate`` request: the prompt as a user message in the model's template
    (with ``system``), or as it is with ``raw``."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    only_known(body, GENERATE_FIELDS, API)
    for name, what in (("suffix", "fill-in-the-middle"), ("template", "a template of the"
                       " request's own"), ("context", "a context of token ids")):  # fmt: skip
        if body.get(name):
            raise bad(f"{name}: {what} is not supported here; send the prompt (and system)")
    options = _options(body)
    _think(body)
    prompt = text_field(body, "prompt")
    images = ImageIntake()
    keys = _images(body.get("images"), "images", images)
    if flag(body, "raw"):
        if keys:
            raise bad("images: with raw the prompt is sent as it is, and an image has no"
                      " place in it; send it without raw (the template places it)")  # fmt: skip
        messages, text = None, prompt
    else:
        system = text_field(body, "system")
        messages = [ChatMessage("system", system)] if system else []
        messages, text = [*messages, ChatMessage("user", prompt, images=keys)], None
    return GenerationRequest(
        text_field(body, "model"),
        messages,
        text,
        _sampling(options),
        _max_tokens(options),
        strings(options.get("stop"), "options.stop"),
        flag(body, "stream", default=True),
        context_limit=integer(options, "num_ctx", 1),
        output_schema=_format(body.get("format")),
        endpoint="ollama_generate",
        keep_alive_s=keep_alive(body),
        sent_images=tuple(images.sent),
    )


def _figures(finished: Finished, started: float, load_s: float) -> dict[str, Any]:
    """The last object's figures, as Ollama counts them: ``prompt_eval_count`` is the
    prompt tokens evaluated now (those the cache supplied are not), ``load_duration`` the
    wait for the model to be loaded (where it was not), in nanoseconds."""
    stats = finished.stats
    eval_s = stats.generated_tokens / stats.gen_tps if stats.gen_tps else 0.0
    return {
        "done_reason": DONE_REASONS.get(finished.reason, "stop"),
        "total_duration": nanoseconds(time.perf_counter() - started),
        "load_duration": nanoseconds(load_s),
        "prompt_eval_count": stats.prompt_tokens_evaluated,
        "prompt_eval_duration": nanoseconds(stats.ttft_s),
        "eval_count": stats.generated_tokens,
        "eval_duration": nanoseconds(eval_s),
    }


def _ollama_calls(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": call.id, "function": {"index": index, "name": call.name,
                                         "arguments": call.arguments}}
            for index, call in enumerate(calls)]  # fmt: skip


class _Reply:
    """A reply's events as Ollama's objects: each piece one object (``message`` for chat,
    ``response`` for generate), the calls in one, then the last with ``done`` and figures."""

    def __init__(
        self, request: GenerationRequest, chat: bool, started: float, load_s: float = 0.0
    ) -> None:
        self.model, self.chat, self.started, self.load_s = request.model, chat, started, load_s

    def _object(self, text: str = "", thinking: str = "", done: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
            if thinking:
                body["message"]["thinking"] = thinking
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        body["done"] = done
        return body

    def objects(self, batch: list[Event]) -> list[dict[str, Any]]:
        out = []
        for event in batch:
            if isinstance(event, Text):
                out.append(self._object(event.text))
            elif isinstance(event, Reasoning):
                out.append(self._object(thinking=event.text))
            elif isinstance(event, Called) and self.chat:
                called = self._object()
                called["message"]["tool_calls"] = _ollama_calls(event.calls)
                out.append(called)
            elif isinstance(event, Finished):
                out.append(
                    {**self._object(done=True), **_figures(event, self.started, self.load_s)}
                )
            elif isinstance(event, Failed):
                out.append(error_body(failure(event.error)))
        return out

    def lines(self, batch: list[Event]) -> bytes:
        return b"".join(
            json.dumps(o, ensure_ascii=False).encode() + b"\n" for o in self.objects(batch)
        )

    def whole(self, text: str, thinking: str, calls: tuple[ToolCall, ...],
              finished: Finished) -> dict[str, Any]:  # fmt: skip
        body = {
            **self._object(text, thinking, done=True),
            **_figures(finished, self.started, self.load_s),
        }
        if calls and self.chat:
            body["message"]["tool_calls"] = _ollama_calls(calls)
        return body


async def respond(
    models: Router, request: GenerationRequest, http: Request, chat: bool
) -> Response:
    """Stream NDJSON (Ollama's default) or return the reply whole. A request with nothing
    to answer (no prompt, no messages) only loads the model, or with ``keep_alive`` 0
    unloads it, as Ollama's clients ask."""
    started = time.perf_counter()
    asked = request.messages[-1].content if request.messages else request.prompt
    pictured = bool(request.messages and request.messages[-1].images)
    if not (request.messages if chat else asked or pictured):
        return await _load_or_unload(models, request, chat)
    turn = await start_turn(models, request)
    reply = _Reply(turn.request, chat, started, turn.load_s)
    if turn.request.stream:
        return StreamingResponse(
            stream_bytes(turn, b"", reply.lines), media_type="application/x-ndjson"
        )
    whole = await whole_reply(turn, http)
    return JSONResponse(reply.whole(whole.text, whole.reasoning, whole.calls, whole.finished))


async def _load_or_unload(models: Router, request: GenerationRequest, chat: bool) -> Response:
    name = models.entry_of(request.model).name
    if request.keep_alive_s == 0:
        await run_in_threadpool(models.unload, name)
        reason = "unload"
    else:
        async with models.hold(name):
            models.keep(name, request.keep_alive_s)
        reason = "load"
    body: dict[str, Any] = {"model": name, "created_at": _now(), "done": True,
                            "done_reason": reason}  # fmt: skip
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(body)


def routes(models: Router) -> list[Endpoint]:
    async def root(_request: Request) -> Response:
        return PlainTextResponse("Ollama is running")  # what Ollama's clients probe for

    async def version(_request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def listed(_request: Request) -> Response:
        return JSONResponse(tags(await run_in_threadpool(served_models, models)))

    async def loaded(_request: Request) -> Response:
        return JSONResponse(running(await run_in_threadpool(served_models, models)))

    async def shown(request: Request) -> Response:
        name = show_request(await read_json(request))
        return JSONResponse(show(await run_in_threadpool(served_model, models, name)))

    async def chat(request: Request) -> Response:
        parsed = await with_images(parse_chat(await read_json(request)))
        return await respond(models, parsed, request, chat=True)

    async def generate(request: Request) -> Response:
        parsed = await with_images(parse_generate(await read_json(request)))
        return await respond(models, parsed, request, chat=False)

    return [
        Endpoint("/", root, ("GET", "HEAD"), versioned=False),
        Endpoint("/api/version", version, ("GET",), versioned=False),
        Endpoint("/api/tags", listed, ("GET",), versioned=False),
        Endpoint("/api/ps", loaded, ("GET",), versioned=False),
        Endpoint("/api/show", shown, versioned=False),
        Endpoint("/api/chat", chat, versioned=False),
        Endpoint("/api/generate", generate, versioned=False),
    ]
