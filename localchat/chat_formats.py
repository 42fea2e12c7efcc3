"""Built-in chat formats: for GGUFs without a template, and for ``--template NAME``.

A GGUF without ``tokenizer.chat_template`` whose vocabulary has a known format's control
tokens gets that format (as llama.cpp's chat code recognises them); a vocabulary with none of
them is a base model and gets a plain transcript whose stop strings end the reply where the
user's next turn would begin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localchat.errors import UsageError


@dataclass(frozen=True)
class ChatFormat:
    """A named template with the control tokens that identify it in a vocabulary."""

    name: str
    source: str
    markers: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()


CHATML = ChatFormat(
    "chatml",
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    ("<|im_start|>", "<|im_end|>"),
)

LLAMA3 = ChatFormat(
    "llama3",
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}",
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
)

# Gemma has no system role: the template rejects it and the renderer folds it into the
# first user message, as llama.cpp does.
GEMMA = ChatFormat(
    "gemma",
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    ("<start_of_turn>", "<end_of_turn>"),
)

MISTRAL = ChatFormat(
    "mistral",
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% endfor %}",
    ("[INST]", "[/INST]"),
)

PHI3 = ChatFormat(
    "phi3",
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}",
    ("<|user|>", "<|assistant|>", "<|end|>"),
)

# A base model's transcript: it has no end-of-turn token, so the reply is stopped where the
# model starts writing the user's next turn. A reply follows "Assistant:" as the model wrote
# it (its own leading space included), so re-rendered it reads exactly as generated.
PLAIN = ChatFormat(
    "plain",
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}Assistant:{{ message['content'] }}"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}{% endif %}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}",
    stop=("\nUser:", "\nSystem:", "\nAssistant:"),
)

# In the order llama.cpp's detection tries them (more specific markers first).
DETECTABLE: tuple[ChatFormat, ...] = (CHATML, LLAMA3, GEMMA, PHI3, MISTRAL)
BUILTIN: dict[str, ChatFormat] = {f.name: f for f in (*DETECTABLE, PLAIN)}


def detect_format(has_control_token: Callable[[str], bool]) -> ChatFormat:
    """The format whose control tokens are all in the vocabulary, else the plain transcript."""
    for chat_format in DETECTABLE:
        if all(has_control_token(marker) for marker in chat_format.markers):
            return chat_format
    return PLAIN


def format_from_override(value: str) -> ChatFormat:
    """``--template NAME`` (a built-in format) or ``--template FILE.jinja``."""
    if value in BUILTIN:
        return BUILTIN[value]
    path = Path(value).expanduser()
    if path.suffix in (".jinja", ".j2", ".jinja2", ".txt") or path.exists():
        try:
            return ChatFormat(path.name, path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read the template file {path}: {exc}") from None
    raise UsageError(
        f"unknown template {value!r}; use one of {', '.join(BUILTIN)} or a .jinja file"
    )
