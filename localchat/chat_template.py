"""Render a conversation with the model's own chat template (Jinja, from GGUF metadata).

Templates run in Jinja's immutable sandbox: a template is data from a downloaded file, so it
may not touch Python objects beyond what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localchat.errors import ModelFileError

# Used for models whose GGUF carries no template: a plain transcript any base model can follow.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; ``render`` gives the prompt text for a list of messages."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or FALLBACK_TEMPLATE
        self.is_fallback = source is None
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise ModelFileError(f"the model's chat template does not compile: {exc}") from None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        context: dict[str, Any] = {
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return self._template.render(**context)
        except TemplateError as exc:
            raise ModelFileError(f"the model's chat template failed: {exc}") from None
