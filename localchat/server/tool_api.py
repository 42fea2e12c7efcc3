"""OpenAI's tools over ``localchat serve``: the ``tools`` a request offers, the calls and
results in its messages, and the ``tool_calls`` a reply makes — parsed from the model's
own format (``chat.tools``), streamed as OpenAI streams them: the text before a call as it
comes, the calls as one delta at the end."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolSpec, call_start, parse_tool_calls

TOOL_CHOICES = ("auto", "none", "required")
LLAMA3_TAG = "<|python_tag|>"
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
    calls are parsed. Llama 3's call is a whole reply that starts with ``{``: a reply that
    starts otherwise streams as text. The generic format (JSON anywhere) holds the reply."""

    family: str
    known: set[str]
    _held: str = ""
    _mode: str = ""  # "" (deciding), "call" (held to the end) or "text" (no call can come)

    def feed(self, piece: str) -> str:
        """What of ``piece`` can be shown now."""
        if self._mode == "text":
            return piece
        self._held += piece
        if self._mode == "call":
            return ""
        if self.family == "llama3":
            return self._feed_llama3()
        marker = call_start(self.family)
        if marker is None:
            self._mode = "call"
            return ""
        at = self._held.find(marker)
        if at != -1:
            shown, self._held = self._held[:at], self._held[at:]
            self._mode = "call"
            return shown
        keep = _partial_suffix(self._held, marker)
        cut = len(self._held) - keep
        shown, self._held = self._held[:cut], self._held[cut:]
        return shown

    def _feed_llama3(self) -> str:
        start = self._held.lstrip()
        if not start or LLAMA3_TAG.startswith(start):
            return ""  # it may still become a call
        if start.startswith(("{", LLAMA3_TAG)):
            self._mode = "call"
            return ""
        self._mode = "text"
        shown, self._held = self._held, ""
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
