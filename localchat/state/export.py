"""A conversation as Markdown or JSON, for `localchat export` and the app's export action.

A message's images are named by their stored files (the export does not copy them): Markdown
links each one before the message's text, JSON lists each with its key, file and size.

A reasoning model's thinking (its ``<think>`` block) is left out unless asked for: an export
is the conversation as read, and the thinking is often longer than the answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from localchat.chat.reasoning import split_reasoning
from localchat.paths import app_paths
from localchat.state.images import ImageStore
from localchat.state.store import ConversationRecord, MessageRecord


def _image_store(images: ImageStore | None) -> ImageStore:
    """The store given, or the data folder's (resolved now)."""
    return images if images is not None else ImageStore(app_paths().images_dir)


def _image_rows(m: MessageRecord, images: ImageStore) -> list[dict[str, Any]]:
    """Each image of the message: its key and file, and what it holds where it is stored."""
    rows: list[dict[str, Any]] = []
    for key in m.images:
        row: dict[str, Any] = {"key": key, "path": str(images.path(key))}
        stored = images.find(key)
        if stored is not None:
            row |= {"mime": stored.mime, "width": stored.width, "height": stored.height}
        rows.append(row)
    return rows


def _image_links(m: MessageRecord, images: ImageStore) -> list[str]:
    """A Markdown image per image of the message, linking its stored file."""
    return [f"![{key[:12]}]({images.path(key).absolute().as_uri()})" for key in m.images]


def _parts(message: MessageRecord) -> tuple[str, str]:
    """(reasoning, content) of a message; only replies think."""
    if message.role != "assistant":
        return "", message.content
    return split_reasoning(message.content)


def _row(m: MessageRecord, reasoning: bool, images: ImageStore) -> dict[str, Any]:
    thought, content = _parts(m)
    row: dict[str, Any] = {
        "role": m.role,
        "content": content,
        "status": m.status,
        "created_at": m.created_at,
        "token_count": m.token_count,
        "stats": m.stats,
        "pinned": m.pinned,
    }
    if reasoning and thought:
        row["reasoning"] = thought
    if m.tool_calls:
        row["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls
        ]
    if m.tool_call_id:
        row["tool_call_id"] = m.tool_call_id
    if m.images:
        row["images"] = _image_rows(m, images)
    return row


def export_json(
    record: ConversationRecord,
    messages: list[MessageRecord],
    reasoning: bool = False,
    tree: list[MessageRecord] | None = None,
    images: ImageStore | None = None,
) -> str:
    """The branch in view as ``messages``; with ``tree`` (every message of every branch),
    also ``tree``: each message with its ``id`` and the ``parent`` it follows. Images are
    looked up in ``images`` (None: the data folder's)."""
    store = _image_store(images)
    rows = [_row(m, reasoning, store) for m in messages]
    payload: dict[str, Any] = {
        "name": record.name,
        "title": record.title,
        "system_prompt": record.system_prompt,
        "model": record.model,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "messages": rows,
    }
    if tree is not None:
        payload["tree"] = [
            {
                "id": m.id,
                "parent": m.parent_id,
                **_row(m, reasoning, store),
                # A first message carries its branches' system prompt.
                **({"system_prompt": m.system_prompt} if m.parent_id is None else {}),
            }
            for m in tree
        ]
        payload["head"] = messages[-1].id if messages else None
    return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"


def export_markdown(
    record: ConversationRecord,
    messages: list[MessageRecord],
    reasoning: bool = False,
    images: ImageStore | None = None,
) -> str:
    """The branch in view; images are linked in ``images`` (None: the data folder's)."""
    store = _image_store(images)
    lines = [f"# {record.title}", ""]
    if record.system_prompt:
        lines += [f"> **system:** {record.system_prompt}", ""]
    for m in messages:
        suffix = " *(stopped)*" if m.status == "partial" else ""
        thought, content = _parts(m)
        lines += [f"## {m.role}{suffix}", ""]
        if reasoning and thought:
            lines += ["<details><summary>reasoning</summary>", "", thought, "", "</details>", ""]
        if m.role == "tool":  # a result is text, fenced: never read as Markdown
            lines += [f"result of call `{m.tool_call_id}`:", "", _fenced(content), ""]
            continue
        if m.images:
            lines += [*_image_links(m, store), ""]
        if content:
            lines += [content, ""]
        for call in m.tool_calls:
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            lines += [f"calls `{call.name}` (call `{call.id}`):", "", _fenced(arguments), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _fenced(text: str) -> str:
    """``text`` in a code fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def export_conversation(
    record: ConversationRecord,
    messages: list[MessageRecord],
    fmt: str,
    reasoning: bool = False,
    tree: list[MessageRecord] | None = None,
    images: ImageStore | None = None,
) -> str:
    """JSON (the branch in view, and every branch as a tree) or Markdown (the branch in
    view)."""
    if fmt == "json":
        return export_json(record, messages, reasoning, tree, images)
    return export_markdown(record, messages, reasoning, images)
