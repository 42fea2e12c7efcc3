"""What the store keeps, as the rest of the runtime reads it: a conversation's and a
message's records, and how their tool calls and token ids are packed into columns."""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall


@dataclass(frozen=True)
class ConversationRecord:
    id: str
    name: str
    title: str
    created_at: float
    updated_at: float
    model: str | None
    system_prompt: str | None
    message_count: int = 0


@dataclass
class MessageRecord:
    id: int
    conversation_id: str
    seq: int
    role: str
    content: str
    token_count: int | None
    created_at: float
    status: str  # "complete" | "partial" (a cancelled or interrupted reply)
    stats: dict[str, Any] = field(default_factory=dict)
    parent_id: int | None = None  # the message it follows (None: the first of its branch)
    pinned: bool = False  # never leaves the context window
    system_prompt: str | None = None  # a first message's: the system prompt of its branches
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls to tools
    tool_call_id: str = ""  # a tool result's: the call it answers
    images: tuple[str, ...] = ()  # the keys of the images it shows (``state.images``)

    @property
    def chat_message(self) -> ChatMessage:
        """The message as a template renders it."""
        return ChatMessage(
            self.role, self.content, self.tool_calls, self.tool_call_id, images=self.images
        )


def pack_calls(calls: Sequence[ToolCall]) -> str | None:
    if not calls:
        return None
    return json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls])


def unpack_calls(text: str | None) -> tuple[ToolCall, ...]:
    if not text:
        return ()
    return tuple(ToolCall(c["name"], c["arguments"], c["id"]) for c in json.loads(text))


def pack_images(keys: Sequence[str]) -> str | None:
    return json.dumps(list(keys)) if keys else None


def unpack_images(text: str | None) -> tuple[str, ...]:
    return tuple(json.loads(text)) if text else ()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    values = array("i")
    values.frombytes(blob)
    return values.tolist()
