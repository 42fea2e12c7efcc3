"""OpenAI's tools over ``localchat serve``: the ``tools`` a request offers, the calls and
results in its messages, and the ``tool_calls`` a reply makes — parsed from the model's
own format (``chat.tools``), streamed as OpenAI streams them: the text before a call as it
comes, the calls as one delta at the end."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolSpec, call_start, parse_tool_calls

TOOL_CHOICES = ("auto", "none", "required")


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


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as OpenAI returns them (arguments as JSON text; ``index`` for stream deltas)."""
    return [
        {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for index, call in enumerate(calls)
    ]


@dataclass
class ToolCallStream:
    """A streamed reply that may call tools: text before the family's call marker goes on
    at once (a marker's possible start held back), the rest waits for the end, where its
    calls are parsed. Families without a marker (a bare JSON call) hold the whole reply."""

    family: str
    known: set[str]
    _held: str = ""
    _in_call: bool = False
    text: str = field(default="")  # everything fed

    def feed(self, piece: str) -> str:
        """What of ``piece`` can be shown now."""
        self.text += piece
        marker = call_start(self.family)
        if marker is None or self._in_call:
            self._held += piece
            return ""
        self._held += piece
        at = self._held.find(marker)
        if at != -1:
            shown, self._held = self._held[:at], self._held[at:]
            self._in_call = True
            return shown
        keep = _partial_suffix(self._held, marker)
        shown, self._held = (
            self._held[: len(self._held) - keep],
            self._held[len(self._held) - keep :],
        )
        return shown

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text still to show and the calls the reply made."""
        content, calls = parse_tool_calls(self._held, self.family, self.known)
        if not calls:
            return self._held, []
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
