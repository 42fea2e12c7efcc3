"""Tools a model may call: their definitions as a chat template takes them, and the calls
each model family writes, found again in its reply.

Templates render OpenAI's ``tools`` list (``{"type": "function", "function": {name,
description, parameters}}``, as llama.cpp's server passes it) and assistant messages with
``tool_calls`` and ``tool`` results. Each family writes its calls its own way (llama.cpp's
server parses the same formats); the family is read off the template's source:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
- ``llama3`` (Llama 3.1–3.3): the reply is ``{"name": …, "parameters": {…}}``
- ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``
- ``phi4`` (Phi-4-mini): ``<|tool_call|>{"name": …, "arguments": {…}}<|/tool_call|>``
- ``lfm2``: ``<|tool_call_start|>[{"name": …, "arguments": {…}}, …]<|tool_call_end|>``
- ``deepseek`` (DeepSeek-R1 and its distills): the name outside the JSON, each call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and a fenced JSON block, between
  ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``; its templates render no ``tools``
  (they are described in the system prompt, with that format)
- ``generic``: a template that knows no tools; a JSON object ``{"name", "arguments"}``
  anywhere in the reply (the tools are described in the system prompt).

Several of the markers are control tokens a reply's text normally leaves out: ``markers``
names them, so the text a parser reads keeps them.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3", "mistral", "phi4", "lfm2", "deepseek", "generic")
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9  # Mistral's templates take ids of exactly nine letters and digits


def new_call_id() -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name, what it does, its JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def schema(self) -> dict[str, Any]:
        """OpenAI's tool definition, as templates index it."""
        function = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters  # type: ignore[assignment]
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: which tool, with which arguments; ``id`` pairs the result."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)

    def as_message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (arguments as an object,
        which every template here writes with ``tojson``)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def as_openai(self) -> dict[str, Any]:
        """The call as OpenAI's API sends it: arguments as JSON text."""
        message = self.as_message()
        message["function"]["arguments"] = json.dumps(self.arguments, ensure_ascii=False)
        return message


TOOL_CHOICES = ("auto", "none", "required")
# What a call the reply made gets where it never ran (a reply stopped on its way to its
# results, a round ended early): every template and server wants each call answered.
NOT_RUN = "error: the call was not run"


@dataclass(frozen=True)
class ToolUse:
    """The tools a reply is offered and how it may use them: ``choice`` is "auto" (the
    model decides), "none" (no calls read; the tools still render, so the prompt's head and
    its cache stay the same), "required" (one call, to any of them) or a tool's name."""

    tools: tuple[ToolSpec, ...] = ()
    choice: str = "auto"

    @property
    def reads_calls(self) -> bool:
        """Whether the reply is read for calls: tools offered, and calls not refused."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether a call must come (generation is held to one by a grammar)."""
        return self.reads_calls and self.choice != "auto"

    @property
    def forced_name(self) -> str | None:
        """The one tool a call must be to (None: any)."""
        return None if self.choice in TOOL_CHOICES else self.choice

    @property
    def names(self) -> set[str]:
        return {tool.name for tool in self.tools}

    def after_call(self) -> ToolUse:
        """The choice for the reply that reads a call's results: a forced choice is relaxed to
        "auto" (the call asked for came; the reply may now answer in words)."""
        return dataclasses.replace(self, choice="auto") if self.forced else self


# DeepSeek's markers (control tokens in its vocabulary).
DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_CALL = re.compile(
    re.escape(DEEPSEEK_CALL[0]) + r"\s*(\w+)\s*" + re.escape(DEEPSEEK_SEP)
    + r"\s*([^\n]+?)\s*\n```(?:json)?\s*(.*?)\s*```\s*" + re.escape(DEEPSEEK_CALL[1]),
    re.DOTALL,
)  # fmt: skip

# Where a family's calls start, and where each ends (None: at the end of the reply).
_MARKERS: dict[str, tuple[str, str | None]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]", None),
    "phi4": ("<|tool_call|>", "<|/tool_call|>"),
    "lfm2": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "deepseek": DEEPSEEK_CALLS,
}


def tool_family(template_source: str) -> str:
    """The call format a chat template teaches its model (``generic`` where none)."""
    for family in ("deepseek", "lfm2", "phi4", "mistral", "hermes"):
        if _MARKERS[family][0] in template_source:
            return family
    if "ipython" in template_source and '"parameters"' in template_source:
        return "llama3"
    return "generic"


def markers(family: str) -> tuple[str, ...]:
    """The strings that open and close a family's calls (kept in a reply's text)."""
    pair = _MARKERS.get(family)
    if pair is None:
        return ()
    inner = (*DEEPSEEK_CALL, DEEPSEEK_SEP) if family == "deepseek" else ()
    return tuple(m for m in pair if m is not None) + inner


def call_start(family: str) -> str | None:
    """The text a family's first call starts with (None: a JSON object, found anywhere)."""
    pair = _MARKERS.get(family)
    return pair[0] if pair else None


def parse_tool_calls(
    text: str, family: str, known: set[str] | None = None
) -> tuple[str, list[ToolCall]]:
    """The reply's text without its calls, and the calls (those of ``known`` tools only,
    where given). Text that only looks like a call stays text."""
    if family in _MARKERS:
        return _parse_marked(text, family, known)
    if family == "llama3":
        return _parse_llama3(text, known)
    return _parse_json_objects(text, known)


def _parse_marked(text: str, family: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
    start, end = _MARKERS[family]
    calls: list[ToolCall] = []
    kept: list[str] = []
    rest = text
    while start in rest:
        before, _, after = rest.partition(start)
        kept.append(before)
        if end is not None and end in after:
            body, _, rest = after.partition(end)
        elif end is None:  # the calls run to the end of their JSON (Mistral's list)
            body, rest = _json_prefix(after)
        else:
            body, rest = after, ""
        found = _deepseek_calls(body, known) if family == "deepseek" else _calls_in(body, known)
        if not found:  # not a call after all: the text stays as it was written
            kept.append(start + body + (end or "") if end and end in after else start + body)
        calls += found
    kept.append(rest)
    return "".join(kept).strip(), calls


def _deepseek_calls(body: str, known: set[str] | None) -> list[ToolCall]:
    """DeepSeek's calls: each a name after its separator and the arguments in a fenced JSON
    block (all of them well formed, or none is a call)."""
    calls = []
    for match in _DEEPSEEK_CALL.finditer(body):
        call = _call_of({"name": match.group(2), "arguments": match.group(3)}, known)
        if call is None:
            return []
        calls.append(call)
    return calls


def _json_prefix(text: str) -> tuple[str, str]:
    """The JSON value ``text`` starts with, and what follows it."""
    stripped = text.lstrip()
    try:
        _value, end = json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return text, ""
    return stripped[:end], stripped[end:]


def _calls_in(body: str, known: set[str] | None) -> list[ToolCall]:
    """The calls in a marked block: one JSON object or a list of them (or LFM2's Python
    calls)."""
    try:
        value = json.loads(body.strip())
    except ValueError:
        return _parse_pythonic(body, known)
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item, known) for item in items]
    return [c for c in calls if c is not None] if all(c is not None for c in calls) else []


CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})


def _call_of(item: object, known: set[str] | None) -> ToolCall | None:
    """A call: a name and its arguments, nothing else (a tool's definition echoed back,
    with its description, is no call)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    if set(item) - CALL_KEYS or ("arguments" not in item and "parameters" not in item):
        return None
    arguments = item.get("arguments", item.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or (known is not None and item["name"] not in known):
        return None
    call_id = item.get("id")
    if isinstance(call_id, str) and call_id:
        return ToolCall(item["name"], arguments, call_id)
    return ToolCall(item["name"], arguments)


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_TOP_LEVEL = re.compile(r"[{\[]")


def _parse_json_objects(text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
    """Calls written as bare JSON (the generic format: an object or a list of them, in a
    code fence or not). Only whole top-level values count: JSON that is no call is left
    as it was written, and nothing inside it is taken for a call."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    match = _TOP_LEVEL.search(text)
    while match is not None:
        index = match.start()
        try:
            value, end = decoder.raw_decode(text, index)
        except ValueError:
            match = _TOP_LEVEL.search(text, index + 1)
            continue
        items = value if isinstance(value, list) else [value]
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            items = value["tool_calls"]
        found = [_call_of(item, known) for item in items]
        if found and all(c is not None for c in found):
            kept.append(text[position:index])
            calls += [c for c in found if c is not None]
            position = end
        match = _TOP_LEVEL.search(text, end)  # past this value, whatever it was
    kept.append(text[position:])
    content = _FENCE.sub(lambda m: "" if not m.group(1).strip() else m.group(0), "".join(kept))
    return content.strip(), calls


def _parse_llama3(text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
    """Llama 3's call is the whole reply: a JSON object (after ``<|python_tag|>``, which it
    may write first), as llama.cpp reads it; a reply that starts otherwise is text."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return text, []
    call = _call_of(value, known)
    if call is None:
        return text, []
    return body[end:].strip(), [call]


def _parse_pythonic(body: str, known: set[str] | None) -> list[ToolCall]:
    """LFM2's own format: ``[name(key="value", n=1), …]``, keyword arguments of literals."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except SyntaxError:
        return []
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return []
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in item.keywords if k.arg}
        except ValueError:
            return []
        if known is not None and item.func.id not in known:
            return []
        calls.append(ToolCall(item.func.id, arguments))
    return calls


def describe_tools(tools: list[ToolSpec], family: str = "generic") -> str:
    """A system prompt's description of the tools and how to call one in ``family``'s
    format (the generic one: a JSON object), for a template that renders no tools itself."""
    if family == "deepseek":
        before, after = named_call_frame("deepseek", "<function name>") or ("", "")
        how = f"reply with {before}<an object of its arguments>{after}"
    else:
        how = (
            'reply with only a JSON object: {"name": <function name>, "arguments": <an object'
            " of its arguments>}"
        )
    lines = [f"You can call these functions. To call one, {how}.", ""]
    lines += [json.dumps(tool.schema()["function"], ensure_ascii=False) for tool in tools]
    return "\n".join(lines)


# The text around a call's JSON object, as each family writes one call (a forced call is
# generated inside this frame), and the key its arguments go under.
_FRAMES: dict[str, tuple[str, str]] = {
    "hermes": ("<tool_call>\n", "\n</tool_call>"),
    "mistral": ("[TOOL_CALLS][", "]"),
    "phi4": ("<|tool_call|>", "<|/tool_call|>"),
    "lfm2": ("<|tool_call_start|>[", "]<|tool_call_end|>"),
}


def call_frame(family: str) -> tuple[str, str]:
    """The text before and after one call's JSON object in ``family``'s format."""
    return _FRAMES.get(family, ("", ""))


def named_call_frame(family: str, name: str) -> tuple[str, str] | None:
    """For a family that writes the tool's name outside the JSON (DeepSeek): the text
    before and after the arguments' object of one call to ``name``; None for the others."""
    if family != "deepseek":
        return None
    before = f"{DEEPSEEK_CALLS[0]}{DEEPSEEK_CALL[0]}function{DEEPSEEK_SEP}{name}\n```json\n"
    return before, f"\n```{DEEPSEEK_CALL[1]}{DEEPSEEK_CALLS[1]}"


def call_schema(family: str, tools: list[ToolSpec], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools`` (or to the one ``name``d): what a
    grammar holds a forced call to. Llama 3 writes its arguments as ``parameters``."""
    key = "parameters" if family == "llama3" else "arguments"
    chosen = [tool for tool in tools if name is None or tool.name == name]
    definitions: dict[str, Any] = {}
    options = []
    for tool in chosen:
        parameters = dict(tool.parameters)
        # Definitions a schema refers to ("#/$defs/…", as pydantic writes them) resolve
        # against the whole call's schema: they move to its root.
        for key_name in ("$defs", "definitions"):
            definitions.update(parameters.pop(key_name, None) or {})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, key: parameters},
                "required": ["name", key],
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"oneOf": options}
    if definitions:
        schema = {**schema, "$defs": definitions, "definitions": definitions}
    return schema
