"""The schema as named steps, each applied once in order and recorded in the database."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable


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


def _create_message_tree(db: sqlite3.Connection) -> None:
    # Conversations become trees: each message follows a parent (an edit or a regenerate adds
    # a sibling, the old continuation stays), and the conversation's head is the last message
    # of the branch in view. Messages that existed form one branch, in their order.
    _run_script(
        db,
        """
        ALTER TABLE messages ADD COLUMN parent_id INTEGER
            REFERENCES messages(id) ON DELETE CASCADE;
        ALTER TABLE messages ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE conversations ADD COLUMN head_id INTEGER;
        UPDATE messages SET parent_id = (
            SELECT p.id FROM messages p
            WHERE p.conversation_id = messages.conversation_id AND p.seq < messages.seq
            ORDER BY p.seq DESC LIMIT 1
        );
        UPDATE conversations SET head_id = (
            SELECT m.id FROM messages m WHERE m.conversation_id = conversations.id
            ORDER BY m.seq DESC LIMIT 1
        );
        CREATE INDEX messages_by_parent ON messages (parent_id);
        """,
    )


def _create_branch_system_prompts(db: sqlite3.Connection) -> None:
    # The system prompt is a branch's: each first message keeps the one its branches were
    # written under (an edited system prompt starts a branch of its own); the conversation's
    # is the branch in view's.
    _run_script(
        db,
        """
        ALTER TABLE messages ADD COLUMN system_prompt TEXT;
        UPDATE messages SET system_prompt = (
            SELECT c.system_prompt FROM conversations c WHERE c.id = messages.conversation_id
        ) WHERE parent_id IS NULL;
        """,
    )


def _add_tool_calls(db: sqlite3.Connection) -> None:
    # Tools: an assistant message keeps the calls it made (JSON: id, name, arguments), a
    # tool message the id of the call it answers.
    _run_script(
        db,
        """
        ALTER TABLE messages ADD COLUMN tool_calls TEXT;
        ALTER TABLE messages ADD COLUMN tool_call_id TEXT;
        """,
    )


# Append-only: never edit or reorder an entry once released; add a new one.
def _create_responses(db: sqlite3.Connection) -> None:
    """Responses kept for OpenAI's Responses API (``store``): a continued conversation is
    read from here by its ``previous_response_id``."""
    _run_script(
        db,
        """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            created_at REAL NOT NULL,
            messages TEXT NOT NULL,
            body TEXT NOT NULL
        );
        CREATE INDEX responses_by_age ON responses (created_at);
        """,
    )


def _add_message_images(db: sqlite3.Connection) -> None:
    # Images: a message keeps the keys of the images it shows (a JSON list, in order; NULL
    # when none), their files in the image store (``state.images``).
    _run_script(db, "ALTER TABLE messages ADD COLUMN images TEXT;")


MIGRATIONS: tuple[tuple[str, Callable[[sqlite3.Connection], None]], ...] = (
    ("001_conversations_and_messages", _create_base),
    ("002_message_tokens", _create_message_tokens),
    ("003_eval_batches", _create_eval_batches),
    ("004_context_windows", _create_context_windows),
    ("005_message_tree", _create_message_tree),
    ("006_branch_system_prompts", _create_branch_system_prompts),
    ("007_tool_calls", _add_tool_calls),
    ("008_responses", _create_responses),
    ("009_message_images", _add_message_images),
)
