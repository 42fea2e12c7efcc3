"""OpenAI's tools over ``localchat serve``: the ``tools`` a request offers, the calls and
results in its messages, and the ``tool_calls`` a reply makes — parsed from the model's
own format (``chat.tools``), streamed as OpenAI streams them: the text before a call as it
comes, the calls as one delta at the end."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from localchat.chat.template import ChatMessage
from localchat.chat.tools import TOOL_CHOICES, ToolCall, ToolSpec

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule (and safe in a grammar)


class ToolRequestError(ValueError):
    """A ``tools``/``tool_choice``/tool message that is not OpenAI's shape: the message says
    what is wrong (the API turns it into a 400)."""


def parse_tools(body: dict[str, Any]) -> tuple[tuple[ToolSpec, ...], str]:
    """The tools a request offers and its ``tool_choice``: "auto", "none", "required" (a
    call to one of them) or the name of the one tool it must call."""
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise ToolRequestError("tools must be a list of {type: function, function: {...}}")
    tools = []
    for index, item in enumerate(raw):
        function = item.get("function") if isinstance(item, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise ToolRequestError(
                f"tools[{index}] must be {{type: function, function: {{name, …}}}}"
            )
        if not TOOL_NAME.fullmatch(name):
            raise ToolRequestError(
                f"tools[{index}].function.name {name!r} must be 1 to 64 letters, digits, _ . -"
            )
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolRequestError(f"tools[{index}].function.parameters must be a JSON schema")
        tools.append(ToolSpec(name, str(function.get("description") or ""), parameters))
    choice = body.get("tool_choice") or "auto"
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if not isinstance(named, str) or named not in {tool.name for tool in tools}:
            raise ToolRequestError(
                f"tool_choice names {named!r}, which is not among the tools offered"
            )
        return tuple(tools), named
    if choice not in TOOL_CHOICES:
        raise ToolRequestError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or"
            f" {{type: function, function: {{name}}}}, not {choice!r}"
        )
    if choice == "required" and not tools:
        raise ToolRequestError("tool_choice required needs tools to call")
    return tuple(tools), str(choice)


def tool_calls_of(item: dict[str, Any], where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (arguments as OpenAI sends them: JSON text)."""
    raw = item.get("tool_calls") or []
    if not isinstance(raw, list):
        raise ToolRequestError(f"{where}.tool_calls must be a list")
    calls = []
    for index, entry in enumerate(raw):
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolRequestError(f"{where}.tool_calls[{index}] must have function.name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise ToolRequestError(
                    f"{where}.tool_calls[{index}].function.arguments is not JSON"
                ) from None
        if not isinstance(arguments, dict):
            raise ToolRequestError(f"{where}.tool_calls[{index}] arguments must be an object")
        call_id = entry.get("id")
        if isinstance(call_id, str) and call_id:
            calls.append(ToolCall(function["name"], arguments, call_id))
        else:
            calls.append(ToolCall(function["name"], arguments))
    return tuple(calls)


def tool_message(role: str, content: str, item: dict[str, Any], where: str) -> ChatMessage:
    """A message with its calls (assistant) or the call it answers (tool)."""
    if role == "tool":
        call_id = item.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ToolRequestError(f"{where}.tool_call_id must name the call it answers")
        return ChatMessage("tool", content, tool_call_id=call_id)
    return ChatMessage(role, content, tool_calls=tool_calls_of(item, where))


def openai_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls as OpenAI returns them (arguments as JSON text; ``index`` for stream deltas)."""
    return [{"index": index, **call.as_openai()} for index, call in enumerate(calls)]
