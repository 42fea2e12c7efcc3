"""Responses kept for OpenAI's Responses API (``store: true``, its default): the
conversation each one ends (so a client that sends only its new input with
``previous_response_id`` continues it, and its prompt state continues too) and the body
``GET /v1/responses/{id}`` returns. Kept in the conversation database, 30 days at most, as
OpenAI keeps them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall
from localchat.state.store import Store

KEEP_S = 30 * 24 * 3600


@dataclass(frozen=True)
class StoredResponse:
    """A kept response: the conversation up to and with its output, and its body."""

    messages: tuple[ChatMessage, ...]
    body: dict[str, Any]


def _message_json(message: ChatMessage) -> dict[str, Any]:
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls]
    return {"role": message.role, "content": message.content, "tool_calls": calls,
            "tool_call_id": message.tool_call_id, "images": list(message.images),
            "image_at": list(message.image_at)}  # fmt: skip


def _message_of(data: dict[str, Any]) -> ChatMessage:
    calls = tuple(ToolCall(c["name"], c["arguments"], c["id"]) for c in data["tool_calls"])
    images = tuple(data.get("images", ()))  # kept before images were read: none
    image_at = tuple(data.get("image_at", ()))  # kept before parts kept their order: first
    return ChatMessage(data["role"], data["content"], calls, data["tool_call_id"], images, image_at)


class ResponseStore:
    """Responses in ``store``'s database (its lock and its transactions)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def save(self, response_id: str, messages: list[ChatMessage], body: dict[str, Any]) -> None:
        """Keep a response (and forget those past ``KEEP_S``)."""
        now = time.time()
        with self.store.transaction() as db:
            db.execute("DELETE FROM responses WHERE created_at < ?", (now - KEEP_S,))
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response_id, now, json.dumps([_message_json(m) for m in messages]),
                 json.dumps(body)),
            )  # fmt: skip

    def get(self, response_id: str) -> StoredResponse | None:
        rows = self.store.read(
            "SELECT messages, body FROM responses WHERE id = ? AND created_at >= ?",
            (response_id, time.time() - KEEP_S),
        )
        if not rows:
            return None
        messages = tuple(_message_of(m) for m in json.loads(rows[0]["messages"]))
        return StoredResponse(messages, json.loads(rows[0]["body"]))

    def delete(self, response_id: str) -> bool:
        """Forget a response; False where there was none."""
        with self.store.transaction() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
