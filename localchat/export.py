"""A conversation as Markdown or JSON, for `localchat export` and the app's export action.

A reasoning model's thinking (its ``<think>`` block) is left out unless asked for: an export
is the conversation as read, and the thinking is often longer than the answer.
"""

from __future__ import annotations

import json
from typing import Any

from localchat.reasoning import split_reasoning
from localchat.store import ConversationRecord, MessageRecord


def _parts(message: MessageRecord) -> tuple[str, str]:
    """(reasoning, content) of a message; only replies think."""
    if message.role != "assistant":
        return "", message.content
    return split_reasoning(message.content)


def export_json(
    record: ConversationRecord, messages: list[MessageRecord], reasoning: bool = False
) -> str:
    rows: list[dict[str, Any]] = []
    for m in messages:
        thought, content = _parts(m)
        row: dict[str, Any] = {
            "role": m.role,
            "content": content,
            "status": m.status,
            "created_at": m.created_at,
            "token_count": m.token_count,
            "stats": m.stats,
        }
        if reasoning and thought:
            row["reasoning"] = thought
        rows.append(row)
    payload = {
        "name": record.name,
        "title": record.title,
        "system_prompt": record.system_prompt,
        "model": record.model,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "messages": rows,
    }
    return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"


def export_markdown(
    record: ConversationRecord, messages: list[MessageRecord], reasoning: bool = False
) -> str:
    lines = [f"# {record.title}", ""]
    if record.system_prompt:
        lines += [f"> **system:** {record.system_prompt}", ""]
    for m in messages:
        suffix = " *(stopped)*" if m.status == "partial" else ""
        thought, content = _parts(m)
        lines += [f"## {m.role}{suffix}", ""]
        if reasoning and thought:
            lines += ["<details><summary>reasoning</summary>", "", thought, "", "</details>", ""]
        lines += [content, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def export_conversation(
    record: ConversationRecord, messages: list[MessageRecord], fmt: str, reasoning: bool = False
) -> str:
    if fmt == "json":
        return export_json(record, messages, reasoning)
    return export_markdown(record, messages, reasoning)
