"""Built-in chat formats: for GGUFs without a template, and for ``--template NAME``.

A GGUF without ``tokenizer.chat_template`` is a base model unless what it carries says it was
tuned for chat (``classify_model``). Its vocabulary cannot say: every Gemma vocabulary has
``<start_of_turn>``, Qwen and SmolLM base vocabularies have ``<|im_start|>``, and a base model
fed a chat format it never learned writes nonsense. What real files do say:

- the end-of-generation token (``tokenizer.ggml.eos_token_id``): chat conversions of ChatML,
  Llama 3 and Phi-3 models end on their end-of-turn token (``<|im_end|>``, ``<|eot_id|>``,
  ``<|end|>``), base ones keep ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``. Gemma and
  Mistral instruct files keep ``<eos>`` / ``</s>`` too, so only the name tells them apart.
  ``tokenizer.ggml.eot_token_id`` is not read: the Gemma converter writes ``<end_of_turn>``
  there for every Gemma file, base ones included (CodeLlama a fill-in-the-middle ``<EOT>``);
- the name: ``general.finetune``, which the converter takes from the model's name
  ("Qwen2.5-0.5B-Instruct" → "Instruct", "gemma-2-2b-it" → "it", "gemma-3-1b-pt" → "pt"),
  and the name fields it derives it from (``general.name``, ``general.basename``,
  ``general.size_label``); then the file's own name. Whole parts only (split on ``-``, ``_``,
  ``.``, space): ``instruct``, ``chat``, ``it``, ``sft``, ``dpo``… mark a chat model, and a
  ``base``, ``pretrain`` or ``pt`` part anywhere wins (a base model). ``general.type`` is
  "model" for every file and says nothing.

A chat model gets the format its vocabulary's control tokens name (as llama.cpp's chat code
recognises them); a base model, or a chat model whose vocabulary names none, gets a plain
transcript whose stop strings end the reply where the user's next turn would begin.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
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


# A chat conversion's end-of-generation token: the end of an assistant turn. Mistral's
# ``[/INST]`` is not one (it closes the user's turn; replies end on ``</s>``, as base models'
# text does), nor is ``<|endoftext|>`` (Qwen, SmolLM and Phi base files end on it).
CHAT_END_TOKENS: frozenset[str] = frozenset(
    {
        "<|im_end|>",
        "<|eot_id|>",
        "<end_of_turn>",
        "<|end|>",
        "<|END_OF_TURN_TOKEN|>",
        "<|end_of_turn|>",  # OpenChat
    }
)
# Whole name parts that mark a model tuned for chat, and those that mark a base model (which
# win: "Qwen3-8B-Base", "gemma-3-1b-pt").
CHAT_PARTS: frozenset[str] = frozenset(
    {"instruct", "instruction", "inst", "chat", "it", "sft", "dpo", "rlhf", "orpo", "assistant"}
)
BASE_PARTS: frozenset[str] = frozenset({"base", "pretrain", "pretrained", "pt"})
# The name fields converters write, ``general.finetune`` (taken from the name) first.
NAME_FIELDS: tuple[str, ...] = (
    "general.finetune",
    "general.name",
    "general.basename",
    "general.size_label",
)
_PART_SEPARATORS = re.compile(r"[-_.\s]+")


@dataclass(frozen=True)
class Tuning:
    """Whether a model without a template was tuned for chat, and the evidence that says so."""

    chat: bool
    evidence: str  # "end token `<|im_end|>`", "general.finetune part 'Instruct'", …

    @property
    def reason(self) -> str:
        """One line for the template's name: "chat-tuned: …" or "base model: …"."""
        return f"{'chat-tuned' if self.chat else 'base model'}: {self.evidence}"


def name_parts(text: str) -> list[str]:
    """A name's whole parts: "gemma-2-2b-it" has an "it" part, "Quantit" has none."""
    return [part for part in _PART_SEPARATORS.split(text) if part]


def _first_part(names: list[tuple[str, str]], wanted: frozenset[str]) -> str | None:
    """Where the first of ``wanted`` is a whole part of a name: "file name part 'it'"."""
    for where, text in names:
        for part in name_parts(text):
            if part.lower() in wanted:
                return f"{where} part {part!r}"
    return None


def classify_model(metadata: Mapping[str, object], eos_text: str, file_name: str) -> Tuning:
    """Base or chat-tuned, from what a template-less file says (see the module docstring):
    a base part in its names wins, then a chat end token, then a chat part; else base."""
    names = [(key, value) for key in NAME_FIELDS if isinstance(value := metadata.get(key), str)]
    names.append(("file name", Path(file_name).name))
    chat_part = _first_part(names, CHAT_PARTS)
    if found := _first_part(names, BASE_PARTS - {"pt"} if chat_part else BASE_PARTS):
        return Tuning(False, found)  # ("pt" is also Portuguese: "…-Instruct-pt-br")
    if eos_text in CHAT_END_TOKENS:
        return Tuning(True, f"end token `{eos_text}`")
    if chat_part:
        return Tuning(True, chat_part)
    return Tuning(False, f"end token `{eos_text}`" if eos_text else "no end token")


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
