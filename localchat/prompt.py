"""A conversation's prompt as token ids, built message by message.

Each message keeps the token ids it was evaluated as, so the next turn's prompt starts with
exactly the tokens the KV cache already holds: re-tokenizing a generated reply from its text
can give other ids (and then the cache misses and the continuation differs). The chat
template is rendered incrementally: message *k*'s segment is what rendering *k* messages adds
to rendering *k - 1*. Templates where that does not hold (they rewrite earlier messages) fall
back to tokenizing the whole rendered prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from localchat.chat_template import ChatMessage, ChatTemplate

Tokenize = Callable[[str], list[int]]


@dataclass
class PromptMessage:
    """A message with the token ids of its whole template segment, once known."""

    role: str
    content: str
    tokens: list[int] | None = None

    def as_chat(self) -> ChatMessage:
        return ChatMessage(self.role, self.content)


@dataclass
class BuiltPrompt:
    """The prompt for the next reply and where each message's tokens sit in it."""

    tokens: list[int]
    # (start, end) of each message's segment within ``tokens``, in message order.
    spans: list[tuple[int, int]] = field(default_factory=list)
    generation_header: str = ""
    exact: bool = True


class PromptBuilder:
    """Renders messages with a template and tokenizes them, reusing recorded token ids."""

    def __init__(self, template: ChatTemplate, tokenize: Tokenize, bos: list[int]) -> None:
        self.template = template
        self.tokenize = tokenize
        self.bos = bos

    def _render(self, messages: Sequence[PromptMessage], generation_prompt: bool) -> str:
        return self.template.render([m.as_chat() for m in messages], generation_prompt)

    def segments(self, messages: Sequence[PromptMessage]) -> list[str] | None:
        """Each message's text segment, or None if the template is not incremental."""
        texts: list[str] = []
        previous = self._render([], False) if messages else ""
        for k in range(1, len(messages) + 1):
            current = self._render(messages[:k], False)
            if not current.startswith(previous):
                return None
            texts.append(current[len(previous) :])
            previous = current
        return texts

    def build(self, messages: Sequence[PromptMessage]) -> BuiltPrompt:
        """The token ids that ask the model for the next assistant reply."""
        closed = self._render(messages, False)
        opened = self._render(messages, True)
        header = opened[len(closed) :] if opened.startswith(closed) else ""
        segments = self.segments(messages)
        bos = self._bos_for(opened)
        if segments is None or not header:
            return BuiltPrompt(bos + self.tokenize(opened), [], header, exact=False)
        tokens = list(bos)
        spans = []
        for message, text in zip(messages, segments, strict=True):
            if message.tokens is None:
                message.tokens = self.tokenize(text)
            spans.append((len(tokens), len(tokens) + len(message.tokens)))
            tokens += message.tokens
        tokens += self.tokenize(header)
        return BuiltPrompt(tokens, spans, header)

    def reply_tokens(
        self,
        messages: Sequence[PromptMessage],
        reply: PromptMessage,
        generated: list[int],
        header: str,
    ) -> list[int] | None:
        """The reply's segment as evaluated: header ids + generated ids + the template's closing.

        ``messages`` are those before the reply; ``header`` the generation prompt it answered.
        None where the template is not incremental (the reply is then re-tokenized as text).
        """
        segments = self.segments([*messages, reply])
        if segments is not None:
            segment = segments[-1]
            if segment.startswith(header + reply.content):
                closing = segment[len(header) + len(reply.content) :]
                return self.tokenize(header) + list(generated) + self.tokenize(closing)
            return self.tokenize(segment)
        return None

    def _bos_for(self, text: str) -> list[int]:
        """BOS is added unless the template writes it itself."""
        bos_text = self.template.bos_token
        return [] if bos_text and text.startswith(bos_text) else list(self.bos)
