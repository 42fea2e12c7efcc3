"""The conversation store on real SQLite: migrations, durability, privacy, search."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from localchat.state.migrations import MIGRATIONS, sql_statements
from localchat.state.store import ConversationNotFound, Store


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
    assert [c.name for c in store.conversations("egg")] == ["recipes"]
    assert [c.name for c in store.conversations("trav")] == ["travel"]
    assert {c.name for c in store.conversations()} == {"recipes", "travel"}


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


def test_migrations_run_as_whole_statements() -> None:
    script = """
        CREATE TABLE t (a TEXT DEFAULT 'x;y');
        CREATE TRIGGER t_ins AFTER INSERT ON t BEGIN UPDATE t SET a = a || ';'; END;
        INSERT INTO t VALUES ('one; two');
    """
    statements = sql_statements(script)
    assert len(statements) == 3
    assert statements[1].startswith("CREATE TRIGGER") and statements[1].endswith("END;")
    db = sqlite3.connect(":memory:")
    for statement in statements:
        db.execute(statement)
    assert db.execute("SELECT a FROM t").fetchone()[0] == "one; two;"
    with pytest.raises(ValueError, match="incomplete SQL statement"):
        sql_statements("CREATE TRIGGER x AFTER INSERT ON t BEGIN SELECT 1;")


def test_a_database_made_by_the_first_schema_is_upgraded_with_its_data(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    name, create_first = MIGRATIONS[0]
    create_first(db)
    db.execute("INSERT INTO _migrations VALUES (?, 0)", (name,))
    columns = [row[1] for row in db.execute("PRAGMA table_info(conversations)")]
    values = {"id": "c1", "name": "old chat", "title": "old", "created_at": 1.0, "updated_at": 1.0}
    db.execute(
        f"INSERT INTO conversations ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
        tuple(values.values()),
    )
    assert "name" in columns
    db.close()
    store = Store(path)
    assert store.applied_migrations == [n for n, _ in MIGRATIONS]
    old = store.get("old chat")
    store.add_message(old.id, "user", "still here", tokens=[1, 2], model_fingerprint="fp")
    assert [m.content for m in store.messages(old.id)] == ["still here"]


def test_a_damaged_database_is_a_clear_error_and_is_never_touched(tmp_path: Path) -> None:
    from localchat.errors import LocalchatError

    path = tmp_path / "data" / "conversations.sqlite3"
    path.parent.mkdir()
    garbage = bytes(range(256)) * 64
    path.write_bytes(garbage)
    with pytest.raises(LocalchatError, match=r"is damaged .* it was left as it is"):
        Store(path)
    assert path.read_bytes() == garbage
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.startswith(".")) == [
        "conversations.sqlite3"
    ]


def test_processes_starting_together_on_a_new_data_dir_all_open_it(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    go = tmp_path / "go"
    path = tmp_path / "fresh" / "conversations.sqlite3"
    code = (
        "import pathlib, sys, time\n"
        "from localchat.state.store import Store\n"
        f"go = pathlib.Path({str(go)!r})\n"
        "while not go.exists(): time.sleep(0.001)\n"
        f"s = Store(pathlib.Path({str(path)!r}))\n"
        "s.create_conversation('c' + sys.argv[1])\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(i)], stderr=subprocess.PIPE, text=True)
        for i in range(6)
    ]
    time.sleep(1.0)  # all waiting at the line
    go.touch()
    results = [(p.wait(60), p.stderr.read() if p.stderr else "") for p in procs]
    assert all(code == 0 for code, _ in results), [err for _, err in results if err]
    assert len(Store(path).conversations()) == 6
