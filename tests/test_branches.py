"""Conversations as trees: an edit or a regenerate starts a branch beside the old one (kept),
only the tokens from the changed message on are evaluated, the continuation is the one a
fresh evaluation of the new branch gives, and ``localchat branch`` forks a conversation
whose first turn restores the shared part from the source's saved cache."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.conversation.turn import ConversationTurn
from localchat.errors import UsageError
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import MIGRATIONS, Store
from tests.conftest import GREEDY

EDITED = "An edited question, quite different from the first one."


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    loaded = Engine(tiny_model, LoadOptions(n_ctx=4096))
    yield loaded
    loaded.close()


def _stores() -> tuple[Store, StateStore]:
    paths = app_paths()
    return Store(paths.database), StateStore(paths.states_dir)


def _say(conversation: Conversation, text: str, fresh: bool = False) -> ConversationTurn:
    turn = conversation.send(text, GREEDY, 16, fresh=fresh)
    for _ in turn:
        pass
    return turn


def _long(engine: Engine, name: str = "long", turns: int = 20, **kw: object) -> Conversation:
    store, states = _stores()
    conversation = Conversation.open(store, states, name, engine, "Be brief.", **kw)  # type: ignore[arg-type]
    for i in range(turns):
        _say(conversation, f"Question {i}: tell me something about topic {i}.")
    conversation.saver.wait()
    return conversation


def test_editing_message_k_evaluates_only_from_k_and_continues_as_a_fresh_read(
    engine: Engine,
) -> None:
    conversation = _long(engine)
    k = 20  # the 11th question
    conversation.branch_before(_id(conversation, k))
    turn = _say(conversation, EDITED)
    stats = turn.stats_dict()
    start_of_k = turn.prompt.spans[1 + k][0]  # after the system prompt's span
    # From message k on (less the template's header, which the old question shared).
    after_k = stats["prompt_tokens"] - start_of_k
    assert after_k - 8 <= stats["prompt_tokens_evaluated"] <= after_k
    assert stats["kept_tokens"] == stats["prompt_tokens"] - stats["prompt_tokens_evaluated"]
    assert stats["kept_tokens"] >= start_of_k > 500
    assert conversation.branches_at(_id(conversation, k)) == (
        2,
        2,
    )  # the old question is kept beside it
    # A fresh read of the edited branch: from nothing, in one go.
    engine.cache.reset()
    fresh = engine.generate(turn.prompt.tokens, GREEDY, 16)
    assert "".join(d.text for d in fresh) == turn.generation.text


def test_the_branches_are_kept_switched_and_reopened(engine: Engine) -> None:
    conversation = _long(engine, turns=3)
    old_question = conversation.exchanges[-2].record.content
    old_reply = conversation.exchanges[-1].record.content
    assert conversation.take_back_last_exchange() == old_question  # a regenerate
    _say(conversation, "A new last question.")
    assert [e.record.content for e in conversation.exchanges][-2] == "A new last question."
    last_user = len(conversation.exchanges) - 2
    assert conversation.branches_at(_id(conversation, last_user)) == (2, 2)
    assert conversation.switch_branch(_id(conversation, last_user), -1)
    assert conversation.exchanges[-1].record.content == old_reply
    assert not conversation.switch_branch(
        _id(conversation, last_user), -1
    )  # no branch before the first
    turn = _say(conversation, "Go on from the old branch.")
    # The cache (of the other branch) was cut where the two part, not read again.
    assert turn.stats_dict()["kept_tokens"] >= turn.prompt.spans[1 + last_user][0] > 50
    conversation.close()
    store, states = _stores()
    reopened = Conversation.open(store, states, "long", engine)
    assert reopened.exchanges[-2].record.content == "Go on from the old branch."
    assert reopened.branches_at(_id(reopened, last_user)) == (1, 2)
    tree = json.loads(_export_json("long"))
    assert len(tree["tree"]) == len(store.all_messages(reopened.record.id)) == 10
    assert tree["head"] == reopened.exchanges[-1].record.id
    assert [m["content"] for m in tree["messages"]] == [
        e.record.content for e in reopened.exchanges
    ]


def _export_json(name: str) -> str:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["export", name, "--format", "json"]) == 0
    return buffer.getvalue()


def test_an_edit_in_a_shifted_window_reads_the_new_branch_exactly(tiny_model: Path) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=256))
    try:
        store, states = _stores()
        conversation = Conversation.open(store, states, "shifted", engine, window_mode="shift")
        turn = None
        for i in range(14):
            turn = _say(conversation, f"Question {i} about topic {i}, in a few words please.")
            if turn.window.mode == "shift":
                break
        assert turn is not None and turn.window.mode == "shift"
        k = len(conversation.exchanges) - 2  # the question that was just answered
        conversation.branch_before(_id(conversation, k))
        edited = _say(conversation, EDITED)
        stats = edited.stats_dict()
        assert stats["window_mode"] == "none"
        # Nothing of the shifted cache was cut and kept: the window was read again.
        assert stats["prompt_tokens_evaluated"] == stats["prompt_tokens"]
        engine.cache.reset()
        fresh = engine.generate(edited.prompt.tokens, GREEDY, 16)
        assert "".join(d.text for d in fresh) == edited.generation.text
    finally:
        engine.close()


def test_branch_forks_a_conversation_that_starts_from_the_saved_cache(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    conversation = _long(engine, turns=6)
    held = conversation.exchanges
    conversation.close()
    assert main(["branch", "long", "--at", "8", "--as", "fork"]) == 0
    assert "into 'fork'" in capsys.readouterr().out
    store, states = _stores()
    engine.cache.reset()  # a new process would start with nothing in memory
    fork = Conversation.open(store, states, "fork", engine)
    assert [e.record.content for e in fork.exchanges] == [e.record.content for e in held[:8]]
    assert fork.record.system_prompt == "Be brief."
    turn = _say(fork, "A question only the fork has.")
    stats = turn.stats_dict()
    assert stats["restored_from_state"] and stats["restored_tokens"] > 200
    assert stats["prompt_tokens_evaluated"] < 30
    # The same turn read from nothing continues the same way.
    engine.cache.reset()
    fresh = engine.generate(turn.prompt.tokens, GREEDY, 16)
    assert "".join(d.text for d in fresh) == turn.generation.text
    assert len(Store(app_paths().database).messages(fork.record.id)) == 10
    assert main(["branch", "long", "--at", "2"]) == 0
    assert "'long-at-2'" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("at", "complaint"),
    [("13", "give 0 to 12"), ("3", "message 3 is a question"), ("-1", "give 0 to 12")],
)
def test_branch_refuses_a_point_that_is_not_in_the_conversation(
    engine: Engine, at: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _long(engine, turns=6).close()
    assert main(["branch", "long", "--at", at]) == 2
    assert complaint in capsys.readouterr().err


def test_branch_refuses_a_name_in_use(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    _long(engine, turns=1).close()
    _long(engine, name="other", turns=1).close()
    assert main(["branch", "long", "--at", "2", "--as", "other"]) == 2
    assert "a conversation named 'other' exists" in capsys.readouterr().err


def test_a_database_from_before_branches_becomes_one_branch(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    for name, apply in MIGRATIONS[:4]:
        apply(db)
        db.execute("INSERT INTO _migrations VALUES (?, 0)", (name,))
    db.execute("INSERT INTO conversations VALUES ('c1', 'old', 'old', 0, 0, NULL, NULL)")
    for seq, role in enumerate(("user", "assistant", "user", "assistant")):
        db.execute(
            "INSERT INTO messages (conversation_id, seq, role, content, created_at)"
            " VALUES ('c1', ?, ?, ?, 0)",
            (seq, role, f"message {seq}"),
        )
    db.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE conversations SET system_prompt = 'Be brief.'")
    db.close()
    store = Store(path)
    messages = store.messages("c1")
    assert messages[0].system_prompt == "Be brief." and messages[1].system_prompt is None
    assert [m.content for m in messages] == [f"message {i}" for i in range(4)]
    assert [m.parent_id for m in messages] == [None, *(m.id for m in messages[:-1])]
    assert store.head("c1") == messages[-1].id
    added = store.add_message("c1", "user", "message 4")
    assert added.parent_id == messages[-1].id and store.head("c1") == added.id


def test_a_pinned_message_never_leaves_the_window(tiny_model: Path) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=192))
    try:
        store, states = _stores()
        conversation = Conversation.open(store, states, "pins", engine, window_mode="shift")
        _say(conversation, "remember this: the code word is falcon")
        conversation.pin(_id(conversation, 0))
        moved = None
        for i in range(12):
            turn = _say(conversation, f"question {i} about a topic, please answer it")
            if turn.window.dropped_messages:
                moved = turn
                break
        assert moved is not None and conversation.window_first > 1
        # What left is one span no more (the pin stays between): re-read, not shifted.
        assert moved.window.mode == "exact"
        assert "falcon" in engine.detokenize(moved.prompt.tokens)
        # The pinned question and its reply stay; the next exchange left.
        assert [conversation.sees(_id(conversation, i)) for i in range(3)] == [True, True, False]
        assert store.messages(conversation.record.id)[0].pinned  # kept in the transcript
        # Unpinned, it leaves with the next turn (read exactly from where it was).
        conversation.pin(_id(conversation, 0), pinned=False)
        after = _say(conversation, "and one more question")
        assert "falcon" not in engine.detokenize(after.prompt.tokens)
        engine.cache.reset()
        fresh = engine.generate(after.prompt.tokens, GREEDY, 16)
        assert "".join(d.text for d in fresh) == after.generation.text
    finally:
        engine.close()


def test_an_edited_system_prompt_starts_a_branch_and_the_old_one_keeps_its_own(
    engine: Engine,
) -> None:
    store, states = _stores()
    conversation = Conversation.open(store, states, "personas", engine, "Answer as a pirate.")
    _say(conversation, "Who are you?")
    _say(conversation, "Where do you sail?")
    old = [e.record.content for e in conversation.exchanges]
    conversation.branch_system_prompt("Answer as a librarian.")
    assert conversation.exchanges == [] and conversation.window_messages() == [
        ChatMessage("system", "Answer as a librarian.")
    ]
    turn = _say(conversation, "Who are you?")
    assert "librarian" in engine.detokenize(turn.prompt.tokens)
    assert conversation.branches_at(_id(conversation, 0)) == (2, 2)
    assert conversation.switch_branch(_id(conversation, 0), -1)
    assert [e.record.content for e in conversation.exchanges] == old
    assert conversation.record.system_prompt == "Answer as a pirate."
    back = _say(conversation, "And your ship?")
    assert "pirate" in engine.detokenize(back.prompt.tokens)
    # In place, a system prompt changes this branch only.
    conversation.set_system_prompt("Answer as a captain.")
    conversation.switch_branch(_id(conversation, 0), 1)
    assert conversation.record.system_prompt == "Answer as a librarian."
    conversation.close()
    reopened = Conversation.open(store, states, "personas", engine)
    assert reopened.record.system_prompt == "Answer as a librarian."
    assert reopened.switch_branch(_id(reopened, 0), -1)
    assert reopened.record.system_prompt == "Answer as a captain."


def test_a_branch_switched_to_keeps_its_own_window(tiny_model: Path) -> None:
    """The window another branch moved is no measure of this one's: a branch that fits is
    seen whole after a switch and after a reopen."""
    engine = Engine(tiny_model, LoadOptions(n_ctx=256))
    try:
        store, states = _stores()
        conversation = Conversation.open(store, states, "drift", engine, window_mode="exact")
        _say(conversation, "Question A0 short.")
        _say(conversation, "Question A1 short.")
        conversation.branch_before(_id(conversation, 2))
        for i in range(14):
            _say(conversation, f"Question B{i} about topic {i}, in a few words please.")
            if conversation.window_first > 2:
                break
        assert conversation.window_first > 2  # branch B moved its window
        assert conversation.switch_branch(_id(conversation, 2), -1)
        assert conversation.window_first == 0 and conversation.sees(_id(conversation, 0))
        turn = _say(conversation, "Next on A")
        assert len(turn.messages) == 5  # all of branch A and the new question
        conversation.close()
        reopened = Conversation.open(store, states, "drift", engine, window_mode="exact")
        assert reopened.window_first == 0
    finally:
        engine.close()


def test_an_edit_into_a_shifted_cache_reads_exactly_after_a_reopen(tiny_model: Path) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=256))
    try:
        store, states = _stores()
        conversation = Conversation.open(store, states, "shift-reopen", engine, window_mode="shift")
        for i in range(14):
            if _say(conversation, f"Question {i} about topic {i}, briefly.").window.mode == "shift":
                break
        conversation.saver.wait()
        conversation.branch_before(_id(conversation, len(conversation.exchanges) - 2))
        conversation.close()
        engine.cache.reset()
        reopened = Conversation.open(store, states, "shift-reopen", engine, window_mode="shift")
        reopened.restore_now()  # as the app does on opening: nothing inexact is restored
        edited = _say(reopened, EDITED)
        engine.cache.reset()
        fresh = engine.generate(edited.prompt.tokens, GREEDY, 16)
        assert "".join(d.text for d in fresh) == edited.generation.text
        assert (
            edited.stats_dict()["prompt_tokens_evaluated"] == edited.stats_dict()["prompt_tokens"]
        )
    finally:
        engine.close()


def test_a_send_that_fails_after_a_branch_began_puts_the_old_branch_back(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversation = _long(engine, turns=2)
    before = [e.record.content for e in conversation.exchanges]
    question = conversation.take_back_last_exchange()  # a regenerate
    assert question is not None

    def refuse(*_args: object, **_kw: object) -> None:
        raise UsageError("the model refused")

    monkeypatch.setattr(engine, "generate", refuse)
    with pytest.raises(UsageError):
        conversation.send(question, GREEDY, 16)
    assert [e.record.content for e in conversation.exchanges] == before
    assert [m.content for m in conversation.store.messages(conversation.record.id)] == before
    conversation.branch_system_prompt("A new persona.")
    with pytest.raises(UsageError):
        conversation.send("hello", GREEDY, 16)
    assert conversation.record.system_prompt == "Be brief."
    assert [e.record.content for e in conversation.exchanges] == before


def test_a_pin_keeps_the_whole_exchange(engine: Engine) -> None:
    conversation = _long(engine, turns=2)
    conversation.pin(_id(conversation, 1))  # a reply: its question comes along
    assert [e.record.pinned for e in conversation.exchanges] == [True, True, False, False]
    conversation.pin(_id(conversation, 0), pinned=False)
    assert not any(e.record.pinned for e in conversation.exchanges)


def _id(conversation: Conversation, index: int) -> int:
    """The id of the message at ``index`` in the branch in view."""
    return conversation.exchanges[index].record.id
