"""A conversation in one process: transcript first, exact token ids, warm cache reuse."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.conversation.local import Conversation
from localchat.errors import UsageError
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY


@pytest.fixture
def engine(tiny_model: Path) -> Engine:
    return Engine(tiny_model, LoadOptions(n_ctx=1024))


@pytest.fixture
def conversation(tmp_path: Path, engine: Engine):
    store = Store(tmp_path / "db.sqlite3")
    conv = Conversation.open(store, StateStore(tmp_path / "states"), "c", engine, "You are terse.")
    yield conv
    conv.close()
    store.close()


def _turn(conversation: Conversation, text: str, max_tokens: int = 12, cancel=None):
    turn = conversation.send(text, GREEDY, max_tokens, cancel)
    for _ in turn:
        pass
    return turn


def test_user_message_is_committed_before_generation_starts(conversation: Conversation) -> None:
    turn = conversation.send("hello", GREEDY, 8)
    other = sqlite3.connect(conversation.store.path)
    rows = other.execute("SELECT role, content FROM messages ORDER BY seq").fetchall()
    assert rows == [("user", "hello")]
    for _ in turn:
        pass
    rows = other.execute("SELECT role FROM messages ORDER BY seq").fetchall()
    assert rows == [("user",), ("assistant",)]


def test_second_turn_evaluates_only_the_new_message(
    conversation: Conversation, engine: Engine
) -> None:
    first = _turn(conversation, "hello there")
    second = _turn(conversation, "tell me more")
    generated = first.generation.tokens
    # The history is kept as evaluated: the first prompt, then the reply's ids as generated.
    assert second.prompt.tokens[: len(first.prompt.tokens) + len(generated)] == (
        first.prompt.tokens + generated
    )
    # Evaluated: the reply's closing, the new message, the header.
    new_text = "<|im_end|>\n<|im_start|>user\ntell me more<|im_end|>\n<|im_start|>assistant\n"
    assert second.stats.prompt_tokens_evaluated == len(engine.tokenize(new_text, special=True))
    assert second.prompt.discarded == 0
    assert not second.restore.restored  # warm, no file read


def test_generated_ids_are_stored_with_the_reply(
    conversation: Conversation, engine: Engine
) -> None:
    turn = _turn(conversation, "hello")
    stored = conversation.store.message_tokens(conversation.record.id, engine.fingerprint)
    reply = conversation.exchanges[-1]
    assert stored == {reply.record.id: turn.generation.tokens}
    assert reply.record.token_count == len(turn.generation.tokens)


def test_cancelled_reply_is_kept_and_marked_partial(conversation: Conversation) -> None:
    cancel = threading.Event()
    turn = conversation.send("go", GREEDY, 100, cancel)
    for count, _delta in enumerate(turn, start=1):
        if count == 3:
            cancel.set()
    messages = conversation.store.messages(conversation.record.id)
    assert messages[-1].status == "partial"
    assert messages[-1].content == turn.generation.text != ""
    assert messages[-1].stats["stop_reason"] == "cancelled"


def test_a_turn_that_cannot_start_keeps_no_half_exchange(tmp_path: Path, engine: Engine) -> None:
    store = Store(tmp_path / "small.sqlite3")
    long_system = "rules " * 900
    conv = Conversation.open(store, StateStore(tmp_path / "s"), "tight", engine, long_system)
    with pytest.raises(UsageError, match=r"cannot hold the system prompt .* use --ctx \d+ or more"):
        conv.send("hello", GREEDY)
    assert conv.exchanges == []
    assert store.messages(conv.record.id) == []
    conv.close()


def test_a_message_longer_than_the_context_is_cut_and_kept_whole(
    conversation: Conversation,
) -> None:
    text = " ".join(f"word{i}" for i in range(1500))
    turn = conversation.send(text, GREEDY, 16)
    for _ in turn:
        pass
    assert turn.window.cut_tokens > 0
    assert any("longer than the context" in notice for notice in turn.notices)
    assert len(turn.prompt.tokens) + 16 <= conversation.backend.n_ctx
    assert turn.messages[-1].content.endswith("word1499")
    stored = conversation.store.messages(conversation.record.id)
    assert stored[0].content == text
