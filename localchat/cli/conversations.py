"""The saved-conversation commands: list, export, branch and delete conversations."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, TextIO

from localchat.paths import app_paths

if TYPE_CHECKING:
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store


def _open_store() -> tuple[Store, StateStore]:
    from localchat.settings import load_settings
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    paths = app_paths()
    settings = load_settings(paths.settings_file)
    return Store(paths.database), StateStore(paths.states_dir, settings.state_budget_bytes)


def cmd_conversations(args: argparse.Namespace, out: TextIO) -> int:
    store, _states = _open_store()
    try:
        records = store.conversations()
    finally:
        store.close()
    if args.json:
        rows = [
            {
                "name": r.name,
                "title": r.title,
                "messages": r.message_count,
                "model": r.model,
                "created_at": r.created_at,
                "updated_at": r.updated_at,
            }
            for r in records
        ]
        out.write(json.dumps(rows, indent=2) + "\n")
        return 0
    if not records:
        out.write(
            "no conversations yet; start one with: localchat ask --conversation NAME MESSAGE\n"
        )
    for r in records:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated_at))
        out.write(f"{r.name}\t{r.message_count} messages\t{when}\t{r.model or '-'}\n")
    return 0


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.state.export import export_conversation

    store, _states = _open_store()
    try:
        record = store.get(args.name)
        messages = store.messages(record.id)
        tree = store.all_messages(record.id)
    finally:
        store.close()
    out.write(export_conversation(record, messages, args.format, args.reasoning, tree))
    return 0


def cmd_branch(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.conversation.records import fork_conversation

    store, states = _open_store()
    try:
        fork, caches = fork_conversation(store, states, args.name, args.at, args.new_name)
    finally:
        store.close()
    start = (
        "its first turn starts from the saved cache of the shared part"
        if caches
        else "no saved cache to start from: its first turn reads the conversation"
    )
    out.write(f"branched {args.name!r} at message {args.at} into {fork.name!r} ({start})\n")
    return 0


def cmd_rm_conversation(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.conversation.records import delete_conversation
    from localchat.state.images import ImageStore

    store, states = _open_store()
    try:
        name = delete_conversation(store, states, ImageStore(app_paths().images_dir), args.name)
    finally:
        store.close()
    out.write(f"deleted conversation {name!r}\n")
    return 0
