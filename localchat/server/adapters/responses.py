"""OpenAI's Responses API (``/v1/responses``): what agents speak that no longer speak chat
completions. ``input`` (a string or items: messages, ``function_call``,
``function_call_output``), ``instructions``, function ``tools`` and ``text.format``
become one ``GenerationRequest``; the reply's events come back as output items
(``reasoning``, ``message``, ``function_call``) or the Responses event stream. A response
is kept (``store``, the default), so a client that sends only its new input with
``previous_response_id`` continues the conversation — and its prompt state with it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localchat.backends.base import Sampling
from localchat.chat.images import Joined, joined_parts
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolSpec, ToolUse
from localchat.server.adapters.openai_chat import format_schema
from localchat.server.adapters.sse import sse_json
from localchat.server.events import Called, Event, Failed, Finished, Reasoning, Text
from localchat.server.images import ImageIntake, image_parts_refused, resolved, store_sent
from localchat.server.requests import (
    ApiError,
    GenerationRequest,
    bad,
    flag,
    integer,
    new_seed,
    number,
    only_known,
    text_field,
)
from localchat.server.router import Router
from localchat.server.tool_api import TOOL_NAME
from localchat.server.turns import failure, start_turn, stream_bytes, whole_reply
from localchat.server.wire import Endpoint, read_json
from localchat.state.responses import ResponseStore

API = "OpenAI's Responses API"
# Accepted as meaning nothing to a local model: ``metadata``, ``user``, ``service_tier``,
# ``safety_identifier``, ``prompt_cache_key`` and ``prompt_cache_retention`` (every prompt
# is cached here), ``include`` (reasoning comes as text anyway), ``parallel_tool_calls``,
# ``max_tool_calls`` (for OpenAI's own tools), ``stream_options``; ``reasoning.effort``.
FIELDS = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
     "temperature", "top_p", "text", "reasoning", "store", "previous_response_id", "stream",
     "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
     "prompt_cache_retention", "include", "parallel_tool_calls", "max_tool_calls",
     "stream_options", "truncation", "background"}
)  # fmt: skip
PING_S = 15
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request: the one internal request, and what the response echoes and
    keeps (the conversation without ``instructions``, which a continuation resends)."""

    request: GenerationRequest
    history: list[ChatMessage]
    echo: dict[str, Any] = field(default_factory=dict)
    store: bool = True
    previous_id: str | None = None


def _parts(content: Any, where: str, images: ImageIntake, field: str = "content") -> Joined:
    """A message's text (or a tool's ``output``): a string or ``input_text``/``output_text``
    parts, and its ``input_image`` parts' (placeholder) keys and places."""
    if isinstance(content, str):
        return content, (), ()
    if not isinstance(content, list):
        raise bad(f"{where}.{field} must be a string or a list of parts", "invalid_type")
    parts: list[tuple[str, str]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.{field}[{index}]"
        if kind in ("input_text", "output_text", "text"):
            assert isinstance(part, dict)
            parts.append(("text", text_field(part, "text")))
        elif kind == "input_image":
            assert isinstance(part, dict)
            if part.get("file_id") is not None:
                raise bad(f"{at}.file_id: this server keeps no files; send the image itself"
                          " as image_url, a data URI", "unsupported_content")  # fmt: skip
            parts.append(("image", images.url(part.get("image_url"), f"{at}.image_url")))
        elif kind in ("input_file", "input_audio"):
            raise bad(f"{at}: {kind} is not read here: send text, and pictures as"
                      " input_image", "unsupported_content")  # fmt: skip
        else:
            raise bad(f"{at}: part type {kind!r} is not one this server takes (input_text,"
                      " output_text, input_image)", "invalid_type")  # fmt: skip
    return joined_parts(parts)


def _with_call(messages: list[ChatMessage], call: ToolCall) -> None:
    """A ``function_call`` item joins the assistant message before it (or starts one)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, call))
    else:
        messages.append(ChatMessage("assistant", "", (call,)))


def _items(value: Any, images: ImageIntake) -> list[ChatMessage]:
    """``input``: a string (one user message) or a list of items."""
    if isinstance(value, str):
        return [ChatMessage("user", value)]
    if not isinstance(value, list):
        raise bad("input must be a string or a list of items", "invalid_type")
    messages: list[ChatMessage] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise bad(f"{where}.role must be user, assistant, system or developer")
            text, keys, image_at = _parts(item.get("content"), where, images)
            if keys:
                image_parts_refused(role, where)
            messages.append(ChatMessage(role, text, images=keys, image_at=image_at))
        elif kind == "function_call":
            arguments = text_field(item, "arguments", "{}")
            try:
                parsed = json.loads(arguments or "{}")
            except ValueError:
                raise bad(f"{where}.arguments is not JSON") from None
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str) or not call_id:
                raise bad(f"{where} must have a name and a call_id", "invalid_type")
            if not isinstance(parsed, dict):
                raise bad(f"{where}.arguments must be a JSON object")
            _with_call(messages, ToolCall(name, parsed, call_id))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.call_id must name the function_call it answers")
            # A tool may answer with a picture (a screenshot), as llama-server takes it.
            text, keys, image_at = _parts(item.get("output"), where, images, "output")
            messages.append(
                ChatMessage("tool", text, tool_call_id=call_id, images=keys, image_at=image_at)
            )
        elif kind == "reasoning":
            continue  # templates drop earlier turns' reasoning: the prompt is the same
        else:
            raise bad(f"{where}: item type {kind!r} is not one this server takes (message,"
                      " function_call, function_call_output, reasoning)", "invalid_type")  # fmt: skip
    return messages


def _tools(body: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], str]:
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise bad("tools must be a list of {type: function, name, parameters}", "invalid_type")
    tools = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(f"{where}: {kind!r} is a tool OpenAI's servers run; this server offers"
                      " the model function tools only")  # fmt: skip
        assert isinstance(tool, dict)
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.name must be 1 to 64 letters, digits, _ . -, not {name!r}")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad(f"{where}.parameters must be a JSON schema", "invalid_type")
        tools.append(ToolSpec(name, text_field(tool, "description"), parameters))
    choice = body.get("tool_choice") or "auto"
    names = {t.name for t in tools}
    if isinstance(choice, dict):
        named = choice.get("name")
        if choice.get("type") != "function" or named not in names:
            raise bad(f"tool_choice names {named!r}, which is not among the function tools")
        return tuple(tools), str(named)
    if choice not in ("auto", "none", "required"):
        raise bad(f"tool_choice must be auto, none, required or {{type: function, name}},"
                  f" not {choice!r}")  # fmt: skip
    if choice == "required" and not tools:
        raise bad("tool_choice required needs tools to call")
    return tuple(tools), str(choice)


def parse_request(body: Any, kept: ResponseStore | None) -> ResponsesRequest:
    """A Responses request, checked, with the conversation it continues read from ``kept``;
    ``ApiError`` names what is wrong."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "invalid_type")
    only_known(body, FIELDS, API)
    if flag(body, "background"):
        raise bad("background: responses run while their client waits here; send it false")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation: only disabled (a prompt past the context is an error)")
    previous_id = body.get("previous_response_id")
    history: list[ChatMessage] = []
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise bad("previous_response_id must be a string", "invalid_type")
        stored = kept.get(previous_id) if kept is not None else None
        if stored is None:
            raise ApiError(404, f"previous_response_id {previous_id!r}: no response kept by"
                           " that id (store: false, or older than 30 days)", code="not_found")  # fmt: skip
        history = list(stored.messages)
    if body.get("input") is None:
        raise bad("input is required: a string or a list of items", "missing_field")
    images = ImageIntake()
    history += _items(body.get("input"), images)
    if images.sent:  # parsed on a worker thread: stored now
        history = resolved(history, store_sent(images.sent))
    instructions = text_field(body, "instructions")
    messages = ([ChatMessage("system", instructions)] if instructions else []) + history
    tools, choice = _tools(body)
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise bad("text must be an object with format", "invalid_type")
    sampling = Sampling(
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=40,
        min_p=0.05,
        seed=new_seed(None),
    )
    request = GenerationRequest(
        text_field(body, "model"), messages, None, sampling,
        integer(body, "max_output_tokens", 1), stream=flag(body, "stream"),
        tool_use=ToolUse(tools, choice),
        output_schema=format_schema(text.get("format"), "text.format"),
        endpoint="responses", request_id=f"resp_{uuid.uuid4().hex[:24]}",
    )  # fmt: skip
    echo = {
        "instructions": instructions or None,
        "max_output_tokens": request.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}},
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "metadata": body.get("metadata") or {},
        "truncation": "disabled",
    }
    return ResponsesRequest(request, history, echo, flag(body, "store", True), previous_id)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _usage(finished: Finished) -> dict[str, Any]:
    stats = finished.stats
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finished.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}  # fmt: skip


def _reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def _call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    arguments = json.dumps(call.arguments, ensure_ascii=False) if status == "completed" else ""
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}  # fmt: skip


@dataclass
class Outcome:
    """What a response came to: its output items and its body, kept where asked."""

    asked: ResponsesRequest
    text: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    items: list[dict[str, Any]] = field(default_factory=list)

    def body(self, finished: Finished | None, status: str | None = None) -> dict[str, Any]:
        """The response object (in progress while ``finished`` is None)."""
        request = self.asked.request
        incomplete = finished is not None and finished.reason in ("length", "context")
        if status is None:
            status = "incomplete" if incomplete else "completed"
        return {
            "id": request.request_id, "object": "response", "created_at": request.created,
            "status": status, "error": None, "model": request.model,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": self.items if finished is not None else [],
            "previous_response_id": self.asked.previous_id, "store": self.asked.store,
            **self.asked.echo,
            "usage": _usage(finished) if finished is not None else None,
        }  # fmt: skip

    def whole_items(self) -> list[dict[str, Any]]:
        """The output items of a reply gathered whole."""
        items = []
        if self.reasoning:
            items.append(_reasoning_item(_item_id("rs"), self.reasoning))
        if self.text or not self.calls:
            items.append(_message_item(_item_id("msg"), self.text))
        items += [_call_item(_item_id("fc"), call) for call in self.calls]
        return items

    def keep(self, kept: ResponseStore | None, body: dict[str, Any]) -> None:
        """Keep the response, with the conversation it ends (``store``)."""
        if kept is None or not self.asked.store:
            return
        said = ChatMessage("assistant", self.text, self.calls)
        kept.save(self.asked.request.request_id, [*self.asked.history, said], body)


class Stream:
    """The reply's events as the Responses event stream: an output item opened for each
    kind of piece as it comes (reasoning, then the message), a ``function_call`` item for
    each call at the end, each done before the next is added; ``response.completed`` (its
    status "incomplete" where the reply was cut) carries the whole response, kept before
    it is sent."""

    def __init__(self, outcome: Outcome, kept: ResponseStore | None) -> None:
        self.outcome, self.kept = outcome, kept
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the item being written
        self.open_text: list[str] = []

    def _event(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return kind, event

    def head(self) -> bytes:
        body = self.outcome.body(None, "in_progress")
        return sse_json([self._event("response.created", response=body),
                         self._event("response.in_progress", response=body)])  # fmt: skip

    def _add(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self.open, self.open_text = item, []
        index = len(self.outcome.items)
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] in ("message", "reasoning"):
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            part: dict[str, Any] = {"type": kind, "text": ""}
            if kind == "output_text":
                part |= {"annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=part))  # fmt: skip
        return events

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item = self.open
        if item is None or item["type"] == "function_call":
            return []
        index, text = len(self.outcome.items), "".join(self.open_text)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = _message_item(item["id"], text)
            events = [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                      self._event("response.content_part.done", **where,
                                  part=done["content"][0])]  # fmt: skip
        else:
            done = _reasoning_item(item["id"], text)
            events = [self._event("response.reasoning_text.done", **where, text=text),
                      self._event("response.content_part.done", **where,
                                  part=done["content"][0])]  # fmt: skip
        self.outcome.items.append(done)
        self.open = None
        return [*events, self._event("response.output_item.done", output_index=index, item=done)]

    def _piece(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            item = (_message_item(_item_id("msg"), "", "in_progress") if kind == "message"
                    else _reasoning_item(_item_id("rs"), None))  # fmt: skip
            events += self._add(item)
        assert self.open is not None
        self.open_text.append(text)
        where = {"item_id": self.open["id"], "output_index": len(self.outcome.items),
                 "content_index": 0}  # fmt: skip
        if kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text,
                                      logprobs=[]))  # fmt: skip
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _calls(self, calls: tuple[ToolCall, ...]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        for call in calls:
            item_id, index = _item_id("fc"), len(self.outcome.items)
            events += self._add(_call_item(item_id, call, "in_progress"))
            done = _call_item(item_id, call)
            where = {"item_id": item_id, "output_index": index}
            events += [
                self._event("response.function_call_arguments.delta", **where,
                            delta=done["arguments"]),
                self._event("response.function_call_arguments.done", **where,
                            arguments=done["arguments"], name=call.name),
                self._event("response.output_item.done", output_index=index, item=done),
            ]  # fmt: skip
            self.outcome.items.append(done)
            self.open = None
        return events

    def write(self, batch: list[Event]) -> bytes:
        events: list[tuple[str, dict[str, Any]]] = []
        outcome = self.outcome
        for event in batch:
            if isinstance(event, Text):
                outcome.text += event.text
                events += self._piece("message", event.text)
            elif isinstance(event, Reasoning):
                outcome.reasoning += event.text
                events += self._piece("reasoning", event.text)
            elif isinstance(event, Called):
                outcome.calls = event.calls
                events += self._calls(event.calls)
            elif isinstance(event, Finished):
                events += self._close()
                body = outcome.body(event)
                outcome.keep(self.kept, body)
                # ``response.completed`` also where the reply was cut (its status says so):
                # the official client's stream helper waits for that event alone.
                events.append(self._event("response.completed", response=body))
            elif isinstance(event, Failed):
                error = failure(event.error)
                events.append(self._event("error", code=error.code or error.kind,
                                          message=str(error), param=None))  # fmt: skip
        return sse_json(events)


def input_tokens_body(count: int) -> dict[str, Any]:
    return {"object": "response.input_tokens", "input_tokens": count}


def deleted_body(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def respond(
    models: Router, asked: ResponsesRequest, http: Request, kept: ResponseStore | None
) -> Response:
    """Admit, tokenize (a prompt past the context is refused before any stream starts),
    then stream the events or return the response whole; kept where ``store`` asks."""
    turn = await start_turn(models, asked.request)
    outcome = Outcome(replace(asked, request=turn.request))
    if turn.request.stream:
        stream = Stream(outcome, kept)
        return EventSourceResponse(stream_bytes(turn, stream.head(), stream.write), ping=PING_S)
    reply = await whole_reply(turn, http)
    outcome.text, outcome.reasoning, outcome.calls = reply.text, reply.reasoning, reply.calls
    outcome.items = outcome.whole_items()
    body = outcome.body(reply.finished)
    await run_in_threadpool(outcome.keep, kept, body)
    return JSONResponse(body)


def routes(models: Router, store: Callable[[], ResponseStore]) -> list[Endpoint]:
    """The Responses API's routes; ``store`` opens the response store at its first use."""

    async def asked_of(request: Request, streamable: bool = True) -> ResponsesRequest:
        body = await read_json(request)
        if not streamable and isinstance(body, dict):
            body = {k: v for k, v in body.items() if k != "stream"}
        return await run_in_threadpool(parse_request, body, await run_in_threadpool(store))

    async def create(request: Request) -> Response:
        asked = await asked_of(request)
        return await respond(models, asked, request, await run_in_threadpool(store))

    async def counted(request: Request) -> Response:
        asked = await asked_of(request, streamable=False)
        async with models.hold(asked.request.model) as runner:
            prompt = await run_in_threadpool(runner.prompt_ids, asked.request)
        return JSONResponse(input_tokens_body(len(prompt)))

    async def read(request: Request) -> Response:
        response_id = str(request.path_params["response_id"])
        stored = await run_in_threadpool(store().get, response_id)
        if stored is None:
            raise ApiError(404, f"no response {response_id!r} is kept here", code="not_found")
        return JSONResponse(stored.body)

    async def delete(request: Request) -> Response:
        response_id = str(request.path_params["response_id"])
        if not await run_in_threadpool(store().delete, response_id):
            raise ApiError(404, f"no response {response_id!r} is kept here", code="not_found")
        return JSONResponse(deleted_body(response_id))

    return [
        Endpoint("/responses", create),
        Endpoint("/responses/input_tokens", counted),
        Endpoint("/responses/{response_id}", read, ("GET",)),
        Endpoint("/responses/{response_id}", delete, ("DELETE",)),
    ]
