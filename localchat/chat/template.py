"""Render a conversation with the model's own chat template (Jinja, from GGUF metadata).

Rendering follows what llama.cpp's server does with a template (its minja engine, and
transformers before it): ``trim_blocks``/``lstrip_blocks``, loop controls, ``tojson`` that
keeps non-ASCII text and takes ``indent``, ``strftime_now`` and ``raise_exception``. Before a
conversation is rendered the template's abilities are probed, as minja does: a template that
rejects (or silently drops) a system role gets the system prompt folded into the first user
message, and a template that demands alternating roles gets consecutive messages of one role
merged. Templates run in Jinja's immutable sandbox: a template is data from a downloaded
file, so it may not touch Python objects beyond what it is given.

Every render (the probes at load too) is bounded in time and size (``chat.sandbox``): past
its bounds a template fails with one line suggesting ``--template``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from jinja2 import TemplateError

from localchat.chat.formats import BUILTIN
from localchat.chat.images import with_image_markers
from localchat.chat.sandbox import (
    CHARS_PER_MESSAGE_CHAR,
    RENDER_CHARS,
    RanAway,
    compile_bounded,
    render_bounded,
)
from localchat.chat.tools import ID_LENGTH, ToolCall, ToolSpec, describe_tools, tool_family
from localchat.errors import ModelFileError, one_line


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool result: the call it answers
    images: tuple[str, ...] = ()  # a user message's images: each one's key (``chat.images``)
    # Where each image goes in ``content`` (offsets, in order); empty: all before the text.
    image_at: tuple[int, ...] = ()

    def with_markers(self) -> ChatMessage:
        """The message with its images as markers in its text (``chat.images``)."""
        marked = with_image_markers(self.content, self.images, self.image_at)
        if marked == self.content:
            return self
        return replace(self, content=marked, images=(), image_at=())

    def as_template_message(self, arguments_as_text: bool = False) -> dict[str, Any]:
        """The message as templates index it (OpenAI's shape; keys only where set: some
        templates test ``'tool_calls' in message``); a call's arguments as JSON text for a
        template that concatenates them (``TemplateCaps.arguments_as_text``)."""
        return self._as_dict(ToolCall.as_openai if arguments_as_text else ToolCall.as_message)

    def as_openai(self) -> dict[str, Any]:
        """The message as OpenAI's API takes it (a call's arguments as JSON text)."""
        return self._as_dict(ToolCall.as_openai)

    def _as_dict(self, call_form: Callable[[ToolCall], dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call_form(call) for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def results_saying(calls: Sequence[ToolCall], text: str) -> list[ChatMessage]:
    """A ``tool`` message for each of ``calls``, all saying ``text`` (calls that never ran)."""
    return [ChatMessage("tool", text, tool_call_id=call.id) for call in calls]


@dataclass(frozen=True)
class TemplateCaps:
    """What a template can take, found by rendering probes (as llama.cpp's minja does)."""

    supports_system_role: bool = True
    requires_alternation: bool = False
    # A call's arguments go in as JSON text: the template adds them to strings (DeepSeek's),
    # which an object would fail.
    arguments_as_text: bool = False


_SYSTEM_NEEDLE = "<System Needle 7f3a>"


class TemplateRunaway(ModelFileError):
    """A template past its bounds: hostile or broken, not "unsupported" (probes let it by)."""


class ChatTemplate:
    """A compiled chat template; ``render`` gives the prompt text for a list of messages.

    ``name`` says where the template came from (for the model panel and ``ask --json``);
    ``stop`` lists strings that end a reply (for formats without an end-of-turn token);
    ``model``, where set, names the model file in errors.
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "the model's own",
        stop: tuple[str, ...] = (),
        model: str = "",
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.stop = stop
        self.model = model
        # What the template did past its bounds, once it has: every later render fails too.
        self._ran_away: str | None = None
        try:
            self._template = compile_bounded(source)
        except (TemplateError, RecursionError) as exc:
            raise ModelFileError(
                f"the chat template {name!r} does not compile: {one_line(exc)}"
            ) from None
        self.caps = self._probe()
        self.tool_family = tool_family(source)

    def _raw(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        now: datetime,
        tools: list[ToolSpec] | None = None,
        arguments_as_text: bool | None = None,
    ) -> str:
        """The template's text for ``messages`` (calls' arguments as text or objects as the
        probes found, unless told)."""
        if self._ran_away is None:
            if arguments_as_text is None:
                arguments_as_text = self.caps.arguments_as_text
            context: dict[str, Any] = {
                "messages": [m.as_template_message(arguments_as_text) for m in messages],
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "strftime_now": now.strftime,
            }
            if tools:  # undefined without tools, as llama.cpp renders it
                context["tools"] = [tool.schema() for tool in tools]
            given = sum(map(len, [m.content for m in messages]))
            given += sum(len(str(tool.schema())) for tool in tools or ())
            limit = RENDER_CHARS + CHARS_PER_MESSAGE_CHAR * given
            try:
                return render_bounded(self._template, context, limit)
            except RanAway as exc:
                self._ran_away = str(exc)
            except RecursionError:
                self._ran_away = "recursed without end"
            except MemoryError:
                self._ran_away = "ran out of memory"
        where = f"{self.model}: " if self.model else ""
        raise TemplateRunaway(
            f"{where}the chat template {self.name!r} {self._ran_away} (it may be hostile or"
            f" broken); choose another with --template {', '.join(BUILTIN)} or a .jinja file"
        )

    def _renders(
        self, messages: list[ChatMessage], needle: str | None = None, as_text: bool = False
    ) -> bool:
        try:
            text = self._raw(messages, False, datetime.now(), arguments_as_text=as_text)
        except TemplateRunaway:
            raise  # past its bounds: hostile or broken, not "unsupported"
        except Exception:  # a probe: any other failure means "not supported"
            return False
        return needle is None or needle in text

    def _probe(self) -> TemplateCaps:
        system = ChatMessage("system", _SYSTEM_NEEDLE)
        user = ChatMessage("user", "Hey")
        call = ToolCall("probe", {"needle": 7}, "probe0001")
        calling = [user, ChatMessage("assistant", "", tool_calls=(call,))]
        return TemplateCaps(
            supports_system_role=self._renders([system, user], _SYSTEM_NEEDLE),
            requires_alternation=not self._renders([user, user]),
            arguments_as_text=not self._renders(calling)
            and self._renders(calling, '"needle"', as_text=True),
        )

    def adapt(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        """The messages as this template can take them (llama.cpp's polyfills)."""
        adapted = list(messages)
        if not self.caps.supports_system_role:
            adapted = _fold_system(adapted)
        if self.caps.requires_alternation:
            adapted = _merge_same_roles(adapted)
        return adapted

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        now: datetime | None = None,
        tools: list[ToolSpec] | None = None,
    ) -> str:
        """The prompt text; ``now`` is what ``strftime_now`` reports (a conversation pins its
        start, so a template that writes today's date gives the same text on every day).
        ``tools`` go to the template, or, where it renders none (``tool_family`` generic),
        into the system prompt with the generic call format. Images go in as markers."""
        messages = [message.with_markers() for message in messages]
        if self.tool_family == "generic":  # no tools in the template: the polyfill's
            messages = _calls_as_text(messages)
            if tools:
                messages = _with_tools_described(messages, tools)
            tools = None
        elif self.tool_family == "deepseek" and tools:  # calls, but no tools rendered
            messages, tools = _with_tools_described(messages, tools, "deepseek"), None
        elif self.tool_family == "mistral":
            messages = _nine_character_ids(messages)
        messages = self.adapt(messages)  # after: the polyfill's messages are adapted too
        try:
            return self._raw(messages, add_generation_prompt, now or datetime.now(), tools)
        except TemplateRunaway:
            raise
        except Exception as exc:  # raise_exception, or broken code: one line, no traceback
            raise ModelFileError(
                f"the chat template {self.name!r} failed: {one_line(exc)}"
            ) from None


def _fold_system(messages: list[ChatMessage]) -> list[ChatMessage]:
    """System text goes to the start of the next user message (or becomes one)."""
    out: list[ChatMessage] = []
    pending = ""
    for message in messages:
        if message.role == "system":
            pending = f"{pending}\n{message.content}" if pending else message.content
            continue
        if pending:
            if message.role == "user":
                content = f"{pending}\n{message.content}" if message.content else pending
                message = ChatMessage("user", content)
            else:
                out.append(ChatMessage("user", pending))
            pending = ""
        out.append(message)
    if pending:
        out.append(ChatMessage("user", pending))
    return out


def _nine_character_ids(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Mistral's templates take call ids of exactly nine letters and digits: any other id
    (a client's ``call_…``) is mapped to one, the same on the call and on its result."""

    def nine(call_id: str) -> str:
        if len(call_id) == ID_LENGTH and call_id.isalnum():
            return call_id
        digest = hashlib.sha256(call_id.encode()).hexdigest()
        return digest[:ID_LENGTH]

    out = []
    for message in messages:
        if message.tool_calls:
            calls = tuple(replace(c, id=nine(c.id)) for c in message.tool_calls)
            message = replace(message, tool_calls=calls)
        elif message.tool_call_id:
            message = replace(message, tool_call_id=nine(message.tool_call_id))
        out.append(message)
    return out


def _calls_as_text(messages: list[ChatMessage]) -> list[ChatMessage]:
    """For a template that renders no tools (as llama.cpp's polyfill does): an assistant's
    calls as the JSON it wrote, a tool's result as a user message saying what it returned."""
    out = []
    for message in messages:
        if message.tool_calls:
            written = "\n".join(
                json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
                for c in message.tool_calls
            )
            content = f"{message.content}\n{written}" if message.content else written
            message = ChatMessage(message.role, content)
        elif message.role == "tool":
            result = {"tool_response": {"id": message.tool_call_id, "content": message.content}}
            message = ChatMessage("user", json.dumps(result, ensure_ascii=False))
        out.append(message)
    return out


def _with_tools_described(
    messages: list[ChatMessage], tools: list[ToolSpec], family: str = "generic"
) -> list[ChatMessage]:
    """The tools described in the system prompt (made where there is none), with how
    ``family`` calls one."""
    described = describe_tools(tools, family)
    if messages and messages[0].role == "system":
        first = messages[0]
        return [ChatMessage("system", f"{first.content}\n\n{described}"), *messages[1:]]
    return [ChatMessage("system", described), *messages]


def _merge_same_roles(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Consecutive messages of one role become one (joined by a blank line); tool calls
    and tool results stay apart (each pairs with its own)."""
    out: list[ChatMessage] = []
    for message in messages:
        apart = message.tool_calls or message.role == "tool" or (out and out[-1].tool_calls)
        if out and out[-1].role == message.role and not apart:
            out[-1] = ChatMessage(message.role, f"{out[-1].content}\n\n{message.content}")
        else:
            out.append(message)
    return out
