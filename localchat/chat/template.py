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

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError

from localchat.chat.formats import BUILTIN
from localchat.chat.sandbox import (
    CHARS_PER_MESSAGE_CHAR,
    RENDER_CHARS,
    RanAway,
    compile_bounded,
    render_bounded,
)
from localchat.errors import ModelFileError, one_line


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class TemplateCaps:
    """What a template can take, found by rendering probes (as llama.cpp's minja does)."""

    supports_system_role: bool = True
    requires_alternation: bool = False


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

    def _raw(self, messages: list[ChatMessage], add_generation_prompt: bool, now: datetime) -> str:
        if self._ran_away is None:
            context: dict[str, Any] = {
                "messages": [{"role": m.role, "content": m.content} for m in messages],
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "strftime_now": now.strftime,
            }
            given = sum(map(len, [m.content for m in messages]))
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

    def _renders(self, messages: list[ChatMessage], needle: str | None = None) -> bool:
        try:
            text = self._raw(messages, False, datetime.now())
        except TemplateRunaway:
            raise  # past its bounds: hostile or broken, not "unsupported"
        except Exception:  # a probe: any other failure means "not supported"
            return False
        return needle is None or needle in text

    def _probe(self) -> TemplateCaps:
        system = ChatMessage("system", _SYSTEM_NEEDLE)
        user = ChatMessage("user", "Hey")
        return TemplateCaps(
            supports_system_role=self._renders([system, user], _SYSTEM_NEEDLE),
            requires_alternation=not self._renders([user, user]),
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
    ) -> str:
        """The prompt text; ``now`` is what ``strftime_now`` reports (a conversation pins its
        start, so a template that writes today's date gives the same text on every day)."""
        try:
            return self._raw(self.adapt(messages), add_generation_prompt, now or datetime.now())
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


def _merge_same_roles(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Consecutive messages of one role become one (joined by a blank line)."""
    out: list[ChatMessage] = []
    for message in messages:
        if out and out[-1].role == message.role:
            out[-1] = ChatMessage(message.role, f"{out[-1].content}\n\n{message.content}")
        else:
            out.append(message)
    return out
