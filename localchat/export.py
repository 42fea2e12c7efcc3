"""A conversation as Markdown or JSON, for `localchat export` and the app's export action."""

from __future__ import annotations

import json

from localchat.store import ConversationRecord, MessageRecord


def export_json(record: ConversationRecord, messages: list[MessageRecord]) -> str:
    payload = {
        "name": record.name,
        "title": record.title,
        "system_prompt": record.system_prompt,
        "model": record.model,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created_at": m.created_at,
                "token_count": m.token_count,
                "stats": m.stats,
            }
            for m in messages
        ],
    }
    return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"


def export_markdown(record: ConversationRecord, messages: list[MessageRecord]) -> str:
    lines = [f"# {record.title}", ""]
    if record.system_prompt:
        lines += [f"> **system:** {record.system_prompt}", ""]
    for m in messages:
        suffix = " *(stopped)*" if m.status == "partial" else ""
        lines += [f"## {m.role}{suffix}", "", m.content, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def export_conversation(record: ConversationRecord, messages: list[MessageRecord], fmt: str) -> str:
    return export_json(record, messages) if fmt == "json" else export_markdown(record, messages)
