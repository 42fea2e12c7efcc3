"""Conversations and messages in SQLite: durable transcripts with append-only migrations.

The user's message is committed before generation starts and the reply when it ends, so a
crash loses at most the reply in progress, never what the user typed. WAL mode lets the app
read while a headless ``ask`` writes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from localchat.chat.tools import ToolCall
from localchat.errors import LocalchatError, UsageError
from localchat.paths import ensure_private_dir
from localchat.state.locks import exclusive
from localchat.state.migrations import MIGRATIONS
from localchat.state.records import (
    ConversationRecord,
    MessageRecord,
    pack_calls,
    pack_images,
    pack_tokens,
    unpack_calls,
    unpack_images,
    unpack_tokens,
)


class ConversationNotFound(LocalchatError):
    """A named conversation does not exist; the message lists near names."""


class Store:
    """The conversation database: one connection, shared safely by the app's thread and its
    workers (every statement runs under one lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            ensure_private_dir(path.parent)
            # Two processes starting together on a new data directory: one creates the
            # database and migrates it while the other waits (switching a new database to
            # WAL is not covered by SQLite's busy timeout).
            with exclusive(path.parent / f".{path.name}.lock"):
                if not path.exists():
                    # Created readable by the user only before SQLite opens it.
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
                self._lock = threading.RLock()
                self.db = sqlite3.connect(
                    path, timeout=10.0, isolation_level=None, check_same_thread=False
                )
                self.db.row_factory = sqlite3.Row
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA foreign_keys=ON")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self._migrate()
        except sqlite3.DatabaseError as exc:
            if "not a database" in str(exc) or "malformed" in str(exc):
                raise LocalchatError(
                    f"the conversation database {path} is damaged ({exc}); it was left as it"
                    " is — move it aside to start a new one, or restore it from a backup"
                ) from None
            raise LocalchatError(
                f"cannot open the conversation database {path}: {exc}; check that the data"
                " directory is writable (or set LOCALCHAT_HOME)"
            ) from None
        except OSError as exc:
            raise LocalchatError(
                f"cannot open the conversation database {path}: {exc}; check that the data"
                " directory is writable (or set LOCALCHAT_HOME)"
            ) from None

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """Rows of one query (under the lock the writers take)."""
        with self._lock:
            return self.db.execute(sql, params).fetchall()

    def _migrate(self) -> None:
        with self.transaction() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)"
            )
            done = {row["name"] for row in db.execute("SELECT name FROM _migrations")}
            for name, apply in MIGRATIONS:
                if name not in done:
                    apply(db)
                    db.execute("INSERT INTO _migrations VALUES (?, ?)", (name, time.time()))

    @property
    def applied_migrations(self) -> list[str]:
        return [row["name"] for row in self.read("SELECT name FROM _migrations ORDER BY name")]

    # -- conversations -----------------------------------------------------------------
    def _conversation(self, row: sqlite3.Row) -> ConversationRecord:
        return ConversationRecord(
            row["id"],
            row["name"],
            row["title"],
            row["created_at"],
            row["updated_at"],
            row["model"],
            row["system_prompt"],
            row["message_count"] if "message_count" in row.keys() else 0,  # noqa: SIM118
        )

    _LIST_SQL = """
        SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count
        FROM conversations c
    """

    def create_conversation(
        self, name: str, system_prompt: str | None = None, model: str | None = None
    ) -> ConversationRecord:
        name = _conversation_name(name)
        with self.transaction() as db:
            _insert_conversation(db, uuid.uuid4().hex, name, model, system_prompt)
        return self.get(name)

    def find(self, name: str) -> ConversationRecord | None:
        rows = self.read(self._LIST_SQL + " WHERE c.name = ?", (name,))
        return self._conversation(rows[0]) if rows else None

    def get(self, name: str) -> ConversationRecord:
        """The conversation called ``name``; the error names the closest existing ones."""
        found = self.find(name)
        if found is None:
            raise ConversationNotFound(
                _not_found_message(name, [c.name for c in self.conversations()])
            )
        return found

    def conversations(self, search: str | None = None) -> list[ConversationRecord]:
        """Most recently updated first; ``search`` matches titles, names and message text."""
        if search:
            like = f"%{search}%"
            rows = self.read(
                self._LIST_SQL
                + """ WHERE c.title LIKE ? OR c.name LIKE ? OR EXISTS (
                    SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?)
                    ORDER BY c.updated_at DESC""",
                (like, like, like),
            )
        else:
            rows = self.read(self._LIST_SQL + " ORDER BY c.updated_at DESC")
        return [self._conversation(row) for row in rows]

    def update_conversation(self, conversation_id: str, **fields: Any) -> None:
        allowed = {"title", "model", "system_prompt", "name"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"cannot update {unknown}")
        assignments = ", ".join(f"{key} = ?" for key in fields)
        with self.transaction() as db:
            db.execute(
                f"UPDATE conversations SET {assignments}, updated_at = ? WHERE id = ?",
                (*fields.values(), time.time(), conversation_id),
            )

    def fork_conversation(
        self, source: ConversationRecord, messages: Sequence[MessageRecord], name: str
    ) -> ConversationRecord:
        """A new conversation ``name`` holding ``messages`` (the first of the source's branch in
        view) with the source's system prompt, each message's token ids per model, and how
        each model's cache of the source was evaluated (its batches replay the shared part)."""
        name = _conversation_name(name)
        if self.find(name) is not None:
            raise UsageError(f"a conversation named {name!r} exists; choose another --as name")
        new_id = uuid.uuid4().hex
        with self.transaction() as db:
            _insert_conversation(db, new_id, name, source.model, source.system_prompt)
            parent: int | None = None
            new_seq: dict[int, int] = {}
            for seq, message in enumerate(messages):
                copy = replace(
                    message,
                    conversation_id=new_id,
                    seq=seq,
                    parent_id=parent,
                    system_prompt=source.system_prompt if parent is None else None,
                )
                message_id = _insert_message(db, copy, message.token_count)
                db.execute(
                    "INSERT INTO message_tokens SELECT ?, model_fingerprint, tokens"
                    " FROM message_tokens WHERE message_id = ?",
                    (message_id, message.id),
                )
                parent = message_id
                new_seq[message.seq] = seq
            db.execute("UPDATE conversations SET head_id = ? WHERE id = ?", (parent, new_id))
            db.execute(
                "INSERT INTO eval_batches SELECT ?, model_fingerprint, tokens, batch_starts"
                " FROM eval_batches WHERE conversation_id = ?",
                (new_id, source.id),
            )
            for row in db.execute(
                "SELECT model_fingerprint, first_seq FROM context_windows WHERE conversation_id = ?",
                (source.id,),
            ).fetchall():
                if row["first_seq"] in new_seq:
                    db.execute(
                        "INSERT INTO context_windows VALUES (?, ?, ?)",
                        (new_id, row["model_fingerprint"], new_seq[row["first_seq"]]),
                    )
        return self.get(name)

    def free_name(self, wanted: str) -> str:
        """``wanted``, or with a counter after it where a conversation has that name."""
        name, counter = wanted, 1
        while self.find(name) is not None:
            counter += 1
            name = f"{wanted}-{counter}"
        return name

    def model_fingerprints(self, conversation_id: str) -> list[str]:
        """The models whose cache of the conversation has a known evaluation record."""
        rows = self.read(
            "SELECT model_fingerprint FROM eval_batches WHERE conversation_id = ?",
            (conversation_id,),
        )
        return [row["model_fingerprint"] for row in rows]

    def delete_conversation(self, conversation_id: str) -> list[str]:
        """Delete a conversation and its messages; the keys of the images that no message
        shows any more (their files are the caller's: ``state.images.delete_unreferenced``)."""
        with self.transaction() as db:
            shown = _image_keys(db, "WHERE m.conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            still = _image_keys(db, "", ())
        return sorted(shown - still)

    def image_references(self) -> set[str]:
        """The keys of the images some message of some conversation shows, or a response
        kept for the Responses API (a client may continue it) does."""
        with self._lock:
            kept = self.db.execute(
                "SELECT DISTINCT j.value FROM responses r, json_each(r.messages) m,"
                " json_each(json_extract(m.value, '$.images')) j"
            ).fetchall()
            return _image_keys(self.db, "", ()) | {row[0] for row in kept}

    # -- messages ----------------------------------------------------------------------
    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        *,
        status: str = "complete",
        stats: dict[str, Any] | None = None,
        tokens: Sequence[int] | None = None,
        model_fingerprint: str | None = None,
        pinned: bool = False,
        tool_calls: Sequence[ToolCall] = (),
        tool_call_id: str = "",
        images: Sequence[str] = (),
    ) -> MessageRecord:
        """Add a message after the branch's last one and commit it (with its token ids for
        one model, if given, and the keys of the images it shows, stored in
        ``state.images``); it becomes the branch's last message."""
        now = time.time()
        with self.transaction() as db:
            seq, parent_id, system_prompt = _next_place(db, conversation_id)
            record = MessageRecord(
                0,
                conversation_id,
                seq,
                role,
                content,
                len(tokens) if tokens else None,
                now,
                status,
                stats or {},
                parent_id,
                pinned,
                system_prompt,
                tuple(tool_calls),
                tool_call_id,
                tuple(images),
            )
            message_id = _insert_message(db, record, len(tokens) if tokens is not None else None)
            if tokens is not None and model_fingerprint:
                db.execute(
                    "INSERT INTO message_tokens VALUES (?, ?, ?)",
                    (message_id, model_fingerprint, pack_tokens(tokens)),
                )
            db.execute(
                "UPDATE conversations SET updated_at = ?, head_id = ? WHERE id = ?",
                (now, message_id, conversation_id),
            )
        return replace(record, id=message_id)

    @staticmethod
    def _message(row: sqlite3.Row) -> MessageRecord:
        return MessageRecord(
            row["id"],
            row["conversation_id"],
            row["seq"],
            row["role"],
            row["content"],
            row["token_count"],
            row["created_at"],
            row["status"],
            json.loads(row["stats"]),
            row["parent_id"],
            bool(row["pinned"]),
            row["system_prompt"],
            unpack_calls(row["tool_calls"]),
            row["tool_call_id"] or "",
            unpack_images(row["images"]),
        )

    def messages(self, conversation_id: str) -> list[MessageRecord]:
        """The branch in view, first message first: the head and the messages it follows."""
        rows = self.read(
            """WITH RECURSIVE branch(id) AS (
                   SELECT head_id FROM conversations WHERE id = ?
                   UNION ALL
                   SELECT m.parent_id FROM messages m JOIN branch b ON m.id = b.id
                   WHERE m.parent_id IS NOT NULL)
               SELECT m.* FROM messages m JOIN branch b ON m.id = b.id ORDER BY m.seq""",
            (conversation_id,),
        )
        return [self._message(row) for row in rows]

    def all_messages(self, conversation_id: str) -> list[MessageRecord]:
        """Every message of every branch, in the order they were written."""
        rows = self.read(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq", (conversation_id,)
        )
        return [self._message(row) for row in rows]

    def head(self, conversation_id: str) -> int | None:
        rows = self.read("SELECT head_id FROM conversations WHERE id = ?", (conversation_id,))
        return rows[0]["head_id"] if rows else None

    def set_head(self, conversation_id: str, message_id: int | None) -> None:
        """Put the branch that ends at ``message_id`` in view (None: before the first)."""
        with self.transaction() as db:
            if message_id is not None:
                found = db.execute(
                    "SELECT 1 FROM messages WHERE id = ? AND conversation_id = ?",
                    (message_id, conversation_id),
                ).fetchone()
                if found is None:
                    raise ValueError(f"message {message_id} is not in this conversation")
            db.execute(
                "UPDATE conversations SET head_id = ?, updated_at = ? WHERE id = ?",
                (message_id, time.time(), conversation_id),
            )

    def siblings(self, message: MessageRecord) -> list[MessageRecord]:
        """The message and the others that follow the same parent (its branches), oldest
        first."""
        parent = "parent_id IS NULL" if message.parent_id is None else "parent_id = ?"
        params: tuple[Any, ...] = (message.conversation_id,)
        if message.parent_id is not None:
            params += (message.parent_id,)
        rows = self.read(
            f"SELECT * FROM messages WHERE conversation_id = ? AND {parent} ORDER BY seq", params
        )
        return [self._message(row) for row in rows]

    def latest_leaf(self, message_id: int) -> int:
        """The last message of the most recently written branch that goes through
        ``message_id``."""
        rows = self.read(
            """WITH RECURSIVE below(id) AS (
                   SELECT ? UNION ALL
                   SELECT m.id FROM messages m JOIN below b ON m.parent_id = b.id)
               SELECT m.id FROM messages m JOIN below b ON m.id = b.id
               ORDER BY m.seq DESC LIMIT 1""",
            (message_id,),
        )
        return int(rows[0]["id"]) if rows else message_id

    def set_system_prompt(self, conversation_id: str, text: str | None) -> None:
        """The branch in view's system prompt, changed in place: the conversation's and its
        first message's (other branches keep theirs)."""
        with self.transaction() as db:
            branch = self.messages(conversation_id)
            db.execute(
                "UPDATE conversations SET system_prompt = ?, updated_at = ? WHERE id = ?",
                (text, time.time(), conversation_id),
            )
            if branch:
                db.execute(
                    "UPDATE messages SET system_prompt = ? WHERE id = ?", (text, branch[0].id)
                )

    def set_pinned(self, message_id: int, pinned: bool) -> None:
        with self.transaction() as db:
            db.execute("UPDATE messages SET pinned = ? WHERE id = ?", (int(pinned), message_id))

    def message_tokens(self, conversation_id: str, model_fingerprint: str) -> dict[int, list[int]]:
        """Message id → the token ids it was evaluated as by this model."""
        rows = self.read(
            """SELECT t.message_id, t.tokens FROM message_tokens t
               JOIN messages m ON m.id = t.message_id
               WHERE m.conversation_id = ? AND t.model_fingerprint = ?""",
            (conversation_id, model_fingerprint),
        )
        return {row["message_id"]: unpack_tokens(row["tokens"]) for row in rows}

    def set_eval_batches(
        self,
        conversation_id: str,
        model_fingerprint: str,
        tokens: Sequence[int],
        batch_starts: Sequence[int] | None,
    ) -> None:
        """Record how the cache was evaluated (None: unknown, the record is dropped)."""
        with self.transaction() as db:
            if batch_starts is None:
                db.execute(
                    "DELETE FROM eval_batches WHERE conversation_id = ? AND model_fingerprint = ?",
                    (conversation_id, model_fingerprint),
                )
                return
            db.execute(
                "INSERT OR REPLACE INTO eval_batches VALUES (?, ?, ?, ?)",
                (
                    conversation_id,
                    model_fingerprint,
                    pack_tokens(tokens),
                    pack_tokens(batch_starts),
                ),
            )

    def eval_batches(
        self, conversation_id: str, model_fingerprint: str
    ) -> tuple[list[int], list[int]] | None:
        """(tokens, batch starts) of this model's last cache of the conversation, if known."""
        rows = self.read(
            "SELECT tokens, batch_starts FROM eval_batches WHERE conversation_id = ? AND model_fingerprint = ?",
            (conversation_id, model_fingerprint),
        )
        if not rows:
            return None
        return unpack_tokens(rows[0]["tokens"]), unpack_tokens(rows[0]["batch_starts"])

    def window_start(self, conversation_id: str, model_fingerprint: str) -> int:
        """The seq of the oldest message in this model's window (0: nothing has left it)."""
        rows = self.read(
            "SELECT first_seq FROM context_windows WHERE conversation_id = ? AND model_fingerprint = ?",
            (conversation_id, model_fingerprint),
        )
        return int(rows[0]["first_seq"]) if rows else 0

    def set_window_start(
        self, conversation_id: str, model_fingerprint: str, first_seq: int
    ) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO context_windows VALUES (?, ?, ?)",
                (conversation_id, model_fingerprint, first_seq),
            )

    def delete_message(self, message: MessageRecord) -> None:
        """Drop a message and everything that follows it (a turn that never started); a
        branch in view that went through it then ends at its parent."""
        with self.transaction() as db:
            db.execute("DELETE FROM messages WHERE id = ?", (message.id,))
            db.execute(
                """UPDATE conversations SET head_id = ? WHERE id = ? AND head_id IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.id = head_id)""",
                (message.parent_id, message.conversation_id),
            )


def _conversation_name(name: str) -> str:
    name = name.strip()
    if not name:
        raise UsageError("a conversation name cannot be empty")
    return name


def _insert_conversation(
    db: sqlite3.Connection,
    conversation_id: str,
    name: str,
    model: str | None,
    system_prompt: str | None,
) -> None:
    now = time.time()
    db.execute(
        "INSERT INTO conversations (id, name, title, created_at, updated_at, model,"
        " system_prompt) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (conversation_id, name, name, now, now, model, system_prompt),
    )


def _next_place(db: sqlite3.Connection, conversation_id: str) -> tuple[int, int | None, str | None]:
    """Where a new message goes: its seq, the message it follows (the branch's head), and
    the system prompt it keeps if it is a branch's first message."""
    seq = db.execute(
        "SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE conversation_id = ?",
        (conversation_id,),
    ).fetchone()[0]
    parent = db.execute(
        "SELECT head_id, system_prompt FROM conversations WHERE id = ?", (conversation_id,)
    ).fetchone()
    parent_id = parent[0] if parent is not None else None
    # A first message keeps the system prompt its branch is written under.
    system_prompt = parent[1] if parent is not None and parent_id is None else None
    return seq, parent_id, system_prompt


def _insert_message(db: sqlite3.Connection, record: MessageRecord, token_count: int | None) -> int:
    """Write the message's row (``record.id`` is a placeholder); the id it got."""
    cursor = db.execute(
        "INSERT INTO messages (conversation_id, seq, role, content, token_count, created_at,"
        " status, stats, parent_id, pinned, system_prompt, tool_calls, tool_call_id, images)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            record.conversation_id,
            record.seq,
            record.role,
            record.content,
            token_count,
            record.created_at,
            record.status,
            json.dumps(record.stats),
            record.parent_id,
            int(record.pinned),
            record.system_prompt,
            pack_calls(record.tool_calls),
            record.tool_call_id or None,
            pack_images(record.images),
        ),
    )
    return int(cursor.lastrowid or 0)


def _image_keys(db: sqlite3.Connection, where: str, params: tuple[Any, ...]) -> set[str]:
    """The image keys the messages ``where`` selects (alias ``m``) show."""
    rows = db.execute(
        "SELECT DISTINCT j.value FROM messages m, json_each(m.images) j"
        f" {where} {'AND' if where else 'WHERE'} m.images IS NOT NULL",
        params,
    ).fetchall()
    return {row[0] for row in rows}


def _not_found_message(name: str, existing: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(name, existing, n=3, cutoff=0.4)
    if near:
        return f"no conversation named {name!r}; did you mean {', '.join(repr(n) for n in near)}?"
    if existing:
        return f"no conversation named {name!r}; `localchat conversations` lists them"
    return f"no conversation named {name!r}; there are no conversations yet"
