"""Conversations and messages in SQLite: durable transcripts with append-only migrations.

The user's message is committed before generation starts and the reply when it ends, so a
crash loses at most the reply in progress, never what the user typed. WAL mode lets the app
read while a headless ``ask`` writes.
"""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localchat.errors import LocalchatError, UsageError
from localchat.locks import exclusive
from localchat.paths import ensure_private_dir


class ConversationNotFound(LocalchatError):
    """A named conversation does not exist; the message lists near names."""


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


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Statement by statement (``executescript`` would commit the migration's transaction),
    each one whole as SQLite reads it: a ``;`` inside a string or a trigger body stays."""
    for statement in sql_statements(script):
        db.execute(statement)


def sql_statements(script: str) -> list[str]:
    """The complete statements of ``script``, in order."""
    statements: list[str] = []
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n\t;"):
                statements.append(pending.strip())
            pending = ""
    if pending.strip(" \n\t;"):
        raise ValueError(f"an incomplete SQL statement: {pending.strip()[:60]}")
    return statements


def _create_base(db: sqlite3.Connection) -> None:
    _run_script(
        db,
        """
        CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            title TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            model TEXT,
            system_prompt TEXT
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            token_count INTEGER,
            created_at REAL NOT NULL,
            status TEXT NOT NULL DEFAULT 'complete',
            stats TEXT NOT NULL DEFAULT '{}',
            UNIQUE (conversation_id, seq)
        );
        CREATE INDEX messages_by_conversation ON messages (conversation_id, seq);
        """,
    )


def _create_message_tokens(db: sqlite3.Connection) -> None:
    # The ids each message was evaluated as, per model: re-evaluation rebuilds the exact cache.
    _run_script(
        db,
        """
        CREATE TABLE message_tokens (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            model_fingerprint TEXT NOT NULL,
            tokens BLOB NOT NULL,
            PRIMARY KEY (message_id, model_fingerprint)
        );
        """,
    )


def _create_eval_batches(db: sqlite3.Connection) -> None:
    # How each model's cache of the conversation was evaluated (tokens and batch starts), so a
    # re-evaluation replays the same batches and continues exactly as the cache would have.
    _run_script(
        db,
        """
        CREATE TABLE eval_batches (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            model_fingerprint TEXT NOT NULL,
            tokens BLOB NOT NULL,
            batch_starts BLOB NOT NULL,
            PRIMARY KEY (conversation_id, model_fingerprint)
        );
        """,
    )


def _create_context_windows(db: sqlite3.Connection) -> None:
    # Where each model's window starts (the oldest message still in it): a resumed
    # conversation rebuilds the same window its saved state holds.
    _run_script(
        db,
        """
        CREATE TABLE context_windows (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            model_fingerprint TEXT NOT NULL,
            first_seq INTEGER NOT NULL,
            PRIMARY KEY (conversation_id, model_fingerprint)
        );
        """,
    )


# Append-only: never edit or reorder an entry once released; add a new one.
MIGRATIONS: tuple[tuple[str, Callable[[sqlite3.Connection], None]], ...] = (
    ("001_conversations_and_messages", _create_base),
    ("002_message_tokens", _create_message_tokens),
    ("003_eval_batches", _create_eval_batches),
    ("004_context_windows", _create_context_windows),
)


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


def _unpack_tokens(blob: bytes) -> list[int]:
    values = array("i")
    values.frombytes(blob)
    return values.tolist()


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

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> builtins.list[sqlite3.Row]:
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
        return [row["name"] for row in self._read("SELECT name FROM _migrations ORDER BY name")]

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
        name = name.strip()
        if not name:
            raise UsageError("a conversation name cannot be empty")
        now = time.time()
        conversation_id = uuid.uuid4().hex
        with self.transaction() as db:
            db.execute(
                "INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, name, name, now, now, model, system_prompt),
            )
        return self.get(name)

    def find(self, name: str) -> ConversationRecord | None:
        rows = self._read(self._LIST_SQL + " WHERE c.name = ?", (name,))
        return self._conversation(rows[0]) if rows else None

    def get(self, name: str) -> ConversationRecord:
        """The conversation called ``name``; the error names the closest existing ones."""
        found = self.find(name)
        if found is None:
            raise ConversationNotFound(_not_found_message(name, [c.name for c in self.list()]))
        return found

    def list(self, search: str | None = None) -> builtins.list[ConversationRecord]:
        """Most recently updated first; ``search`` matches titles, names and message text."""
        if search:
            like = f"%{search}%"
            rows = self._read(
                self._LIST_SQL
                + """ WHERE c.title LIKE ? OR c.name LIKE ? OR EXISTS (
                    SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?)
                    ORDER BY c.updated_at DESC""",
                (like, like, like),
            )
        else:
            rows = self._read(self._LIST_SQL + " ORDER BY c.updated_at DESC")
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

    def delete_conversation(self, conversation_id: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

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
    ) -> MessageRecord:
        """Append a message and commit it (with its token ids for one model, if given)."""
        now = time.time()
        with self.transaction() as db:
            seq = db.execute(
                "SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE conversation_id = ?",
                (conversation_id,),
            ).fetchone()[0]
            cursor = db.execute(
                "INSERT INTO messages (conversation_id, seq, role, content, token_count, created_at,"
                " status, stats) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    seq,
                    role,
                    content,
                    len(tokens) if tokens is not None else None,
                    now,
                    status,
                    json.dumps(stats or {}),
                ),
            )
            message_id = int(cursor.lastrowid or 0)
            if tokens is not None and model_fingerprint:
                db.execute(
                    "INSERT INTO message_tokens VALUES (?, ?, ?)",
                    (message_id, model_fingerprint, _pack_tokens(tokens)),
                )
            db.execute(
                "UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id)
            )
        return MessageRecord(
            message_id,
            conversation_id,
            seq,
            role,
            content,
            len(tokens) if tokens else None,
            now,
            status,
            stats or {},
        )

    def messages(self, conversation_id: str) -> builtins.list[MessageRecord]:
        rows = self._read(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY seq", (conversation_id,)
        )
        return [
            MessageRecord(
                row["id"],
                row["conversation_id"],
                row["seq"],
                row["role"],
                row["content"],
                row["token_count"],
                row["created_at"],
                row["status"],
                json.loads(row["stats"]),
            )
            for row in rows
        ]

    def message_tokens(
        self, conversation_id: str, model_fingerprint: str
    ) -> dict[int, builtins.list[int]]:
        """Message id → the token ids it was evaluated as by this model."""
        rows = self._read(
            """SELECT t.message_id, t.tokens FROM message_tokens t
               JOIN messages m ON m.id = t.message_id
               WHERE m.conversation_id = ? AND t.model_fingerprint = ?""",
            (conversation_id, model_fingerprint),
        )
        return {row["message_id"]: _unpack_tokens(row["tokens"]) for row in rows}

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
                    _pack_tokens(tokens),
                    _pack_tokens(batch_starts),
                ),
            )

    def eval_batches(
        self, conversation_id: str, model_fingerprint: str
    ) -> tuple[builtins.list[int], builtins.list[int]] | None:
        """(tokens, batch starts) of this model's last cache of the conversation, if known."""
        rows = self._read(
            "SELECT tokens, batch_starts FROM eval_batches WHERE conversation_id = ? AND model_fingerprint = ?",
            (conversation_id, model_fingerprint),
        )
        if not rows:
            return None
        return _unpack_tokens(rows[0]["tokens"]), _unpack_tokens(rows[0]["batch_starts"])

    def window_start(self, conversation_id: str, model_fingerprint: str) -> int:
        """The seq of the oldest message in this model's window (0: nothing has left it)."""
        rows = self._read(
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

    def delete_messages_from(self, conversation_id: str, seq: int) -> None:
        """Drop messages from ``seq`` on (regenerate, edit)."""
        with self.transaction() as db:
            db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND seq >= ?",
                (conversation_id, seq),
            )


def _not_found_message(name: str, existing: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(name, existing, n=3, cutoff=0.4)
    if near:
        return f"no conversation named {name!r}; did you mean {', '.join(repr(n) for n in near)}?"
    if existing:
        return f"no conversation named {name!r}; `localchat conversations` lists them"
    return f"no conversation named {name!r}; there are no conversations yet"
