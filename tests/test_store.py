"""The conversation store on real SQLite: migrations, durability, privacy, search."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from localchat.store import MIGRATIONS, ConversationNotFound, Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "data" / "db.sqlite3")


def test_migrations_are_applied_once_in_order(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    first = Store(path)
    assert first.applied_migrations == [name for name, _ in MIGRATIONS]
    first.close()
    again = Store(path)  # re-opening applies nothing twice
    assert again.applied_migrations == [name for name, _ in MIGRATIONS]
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_database_is_private(store: Store) -> None:
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700


def test_messages_keep_order_tokens_and_status(store: Store) -> None:
    conv = store.create_conversation("trip", system_prompt="be brief", model="m.gguf")
    user = store.add_message(conv.id, "user", "hello", tokens=[1, 2, 3], model_fingerprint="fp")
    store.add_message(conv.id, "assistant", "hi the", status="partial", stats={"gen_tps": 3.5})
    messages = store.messages(conv.id)
    assert [(m.seq, m.role, m.status) for m in messages] == [
        (0, "user", "complete"),
        (1, "assistant", "partial"),
    ]
    assert messages[1].stats == {"gen_tps": 3.5}
    assert store.message_tokens(conv.id, "fp") == {user.id: [1, 2, 3]}
    assert store.message_tokens(conv.id, "other-model") == {}
    # Committed: a second connection sees it at once.
    other = sqlite3.connect(store.path)
    assert other.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 2


def test_search_matches_titles_and_message_text(store: Store) -> None:
    a = store.create_conversation("recipes")
    store.add_message(a.id, "user", "how long to boil an egg")
    store.create_conversation("travel")
    assert [c.name for c in store.list("egg")] == ["recipes"]
    assert [c.name for c in store.list("trav")] == ["travel"]
    assert {c.name for c in store.list()} == {"recipes", "travel"}


def test_unknown_name_lists_near_names(store: Store) -> None:
    store.create_conversation("project-notes")
    store.create_conversation("groceries")
    with pytest.raises(ConversationNotFound, match="did you mean 'project-notes'"):
        store.get("project-note")


def test_delete_cascades_to_messages_and_tokens(store: Store) -> None:
    conv = store.create_conversation("gone")
    store.add_message(conv.id, "user", "x", tokens=[5], model_fingerprint="fp")
    store.delete_conversation(conv.id)
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    assert store.db.execute("SELECT COUNT(*) FROM message_tokens").fetchone()[0] == 0


def test_unwritable_data_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(Exception, match="cannot open the conversation database"):
        Store(blocker / "data" / "db.sqlite3")
