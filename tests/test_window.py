"""Sliding-window context on the tiny model with a 256-token context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.window import WindowPolicy, plan_window, resolve_mode, shift_is_safe
from localchat.conversation.local import Conversation
from localchat.errors import UsageError
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

CTX = 256
SYSTEM = "You are a careful assistant who never forgets this instruction."


def _open(tmp_path: Path, model: Path, name: str = "long", mode: str = "auto") -> Conversation:
    engine = Engine(model, LoadOptions(n_ctx=CTX))
    store = Store(tmp_path / "db.sqlite3")
    return Conversation.open(
        store, StateStore(tmp_path / "states"), name, engine, SYSTEM, window_mode=mode
    )


def _turn(conversation: Conversation, text: str, max_tokens: int = 24):
    turn = conversation.send(text, GREEDY, max_tokens)
    for _ in turn:
        pass
    return turn


def _new_tokens(engine: Engine, turn) -> int:
    """What a turn should evaluate: the reply's closing, the user's segment and the
    generation header — nothing of the history."""
    text = turn.user.record.content
    new = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return len(engine.tokenize(new, special=True))


def _spelled(engine: Engine, tokens: list[int]) -> str:
    return b"".join(engine.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")


def _message(i: int) -> str:
    return f"message {i}: " + " ".join(f"w{i}x{j}" for j in range(6))


def test_a_conversation_of_five_contexts_runs_to_the_end(tmp_path: Path, tiny_model: Path) -> None:
    conversation = _open(tmp_path, tiny_model)
    engine = conversation.backend
    head = engine.prompt_builder().build(conversation.system_messages()).tokens
    head = head[: len(head) - len(engine.tokenize("<|im_start|>assistant\n", special=True))]
    total, moves = 0, []
    i = 0
    while total < 5 * CTX:
        turn = _turn(conversation, _message(i))
        i += 1
        total += turn.stats.prompt_tokens_evaluated + turn.stats.generated_tokens
        if turn.window.dropped_messages:
            moves.append(turn)
        cached = engine.cache.cached_tokens
        # The system prompt stays at the head of the window after every move.
        assert cached[: len(head)] == head
        # The cache is exactly the window's messages as the template renders them, then the
        # reply as generated.
        rendered = "<s>" + conversation.builder.render(turn.messages)
        assert _spelled(engine, turn.prompt.tokens) == rendered
        assert cached == turn.prompt.tokens + turn.generation.tokens
        assert len(cached) < CTX
    assert len(moves) >= 3
    for turn in moves:
        assert turn.window.mode == "shift"
        assert turn.window.dropped_messages % 2 == 0  # questions leave with their answers
        assert turn.window.dropped_tokens >= CTX // 4
        assert turn.stats.prompt_tokens_evaluated == _new_tokens(engine, turn)
        assert any("left the context window" in n for n in turn.notices)
    assert len(conversation.store.messages(conversation.record.id)) == 2 * i  # transcript keeps all
    conversation.close()


def test_exact_mode_equals_a_cold_evaluation_of_the_window(
    tmp_path: Path, tiny_model: Path
) -> None:
    conversation = _open(tmp_path, tiny_model, mode="exact")
    moved = None
    for i in range(30):
        turn = _turn(conversation, _message(i))
        if turn.window.dropped_messages:
            moved = turn
            break
    assert moved is not None and moved.window.mode == "exact"
    assert moved.stats.prompt_tokens_evaluated == len(moved.prompt.tokens)
    cold = Engine(tiny_model, LoadOptions(n_ctx=CTX))
    generation = cold.generate(moved.prompt.tokens, GREEDY, 24)
    for _ in generation:
        pass
    assert generation.tokens == moved.generation.tokens
    conversation.close()


def test_a_resumed_conversation_past_the_window_restores_and_continues(
    tmp_path: Path, tiny_model: Path
) -> None:
    conversation = _open(tmp_path, tiny_model)
    i = 0
    while conversation.window_first == 0:
        _turn(conversation, _message(i))
        i += 1
    _turn(conversation, _message(i))
    first = conversation.window_first
    conversation.close()
    conversation.store.close()

    reopened = _open(tmp_path, tiny_model)
    assert reopened.window_first == first
    turn = _turn(reopened, "one more question")
    assert turn.restore.restored
    assert turn.stats.prompt_tokens_evaluated == _new_tokens(reopened.backend, turn)
    # And it keeps shifting correctly afterwards.
    for j in range(12):
        turn = _turn(reopened, _message(100 + j))
        assert len(reopened.backend.cache.cached_tokens) < CTX
    reopened.close()


def test_ask_reports_window_fields(tiny_model: Path) -> None:
    result = None
    for i in range(14):
        completed = subprocess.run(
            [sys.executable, "-m", "localchat.cli.main", "ask", _message(i), "--model-path", str(tiny_model),
             "--conversation", "cli", "--ctx", str(CTX), "--temperature", "0", "--max-tokens", "24",
             "--json", "--window", "auto"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        result = json.loads(completed.stdout)
        if result["stats"]["window_dropped_messages"]:
            break
    assert result is not None
    stats = result["stats"]
    assert stats["window_dropped_messages"] >= 2 and stats["window_dropped_tokens"] > 0
    assert stats["window_mode"] == "shift"
    assert stats["restored_from_state"] is True
    assert any("left the context window" in n for n in result["notices"])


def test_plan_keeps_pairs_together_and_drops_a_share() -> None:
    policy = WindowPolicy(reply_reserve_share=0.25, drop_share=0.25)
    messages = [("user", 40), ("assistant", 40), ("user", 40), ("assistant", 40), ("user", 40)]
    plan = plan_window(20, messages, 0, 256, 64, policy)
    assert plan.first == 2 and plan.dropped_messages == 2 and plan.dropped_tokens == 80
    fits = plan_window(20, messages[:3], 0, 256, 64, policy)
    assert not fits.moved


def test_a_turn_that_reads_tool_results_keeps_their_question_and_calls() -> None:
    policy = WindowPolicy(reply_reserve_share=0.25, drop_share=0.25)
    messages = [("user", 40), ("assistant", 40), ("user", 40), ("assistant", 60), ("tool", 80)]
    plan = plan_window(20, messages, 0, 256, 64, policy)
    # The old exchange goes; the question, its calls and their results stay (cut if need be).
    assert plan.first == 2 and plan.dropped_messages == 2
    assert plan_window(20, messages, 0, 200, 64, policy).first == 2


def test_context_too_small_for_the_system_prompt_names_the_minimum() -> None:
    with pytest.raises(UsageError, match=r"use --ctx 316 or more"):
        plan_window(300, [("user", 5)], 0, 256, 0, WindowPolicy())


def test_shift_is_only_used_where_safe() -> None:
    assert shift_is_safe("llama", 0, True)
    assert not shift_is_safe("gemma2", 4096, True)
    assert not shift_is_safe("deepseek2", 0, True)
    assert not shift_is_safe("llama", 0, False)
    assert resolve_mode("auto", False) == "exact"
    assert resolve_mode("shift", True) == "shift"
    with pytest.raises(UsageError, match="unknown window mode"):
        resolve_mode("sideways", True)


def test_a_turn_that_fails_after_the_window_moved_leaves_everything_as_it_was(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from localchat.errors import ModelLoadError

    steady = _open(tmp_path / "a", tiny_model, "steady")
    failing = _open(tmp_path / "b", tiny_model, "failing")
    i = 0
    while True:  # both fill their window; the next message would move it
        a, b = _turn(steady, _message(i)), _turn(failing, _message(i))
        assert a.generation.text == b.generation.text
        i += 1
        if a.window.dropped_messages:
            break
    failing.saver.wait(30)  # the last turn's state is on disk, as seconds after a reply
    before = (failing.window_first, len(failing.exchanges), failing.backend.cache.cached_tokens)
    stored = [m.content for m in failing.store.messages(failing.record.id)]
    calls = {"n": 0}
    real_generate = failing.backend.generate

    def broken_generate(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        raise ModelLoadError("llama.cpp could not start the turn (injected)")

    monkeypatch.setattr(failing.backend, "generate", broken_generate)
    text = _message(i) + " " + "and a long tail of words that moves the window " * 4
    with pytest.raises(ModelLoadError, match="injected"):
        failing.send(text, GREEDY, 24)
    assert calls["n"] == 1
    assert (failing.window_first, len(failing.exchanges)) == before[:2]
    assert [m.content for m in failing.store.messages(failing.record.id)] == stored
    monkeypatch.setattr(failing.backend, "generate", real_generate)
    # The retry gives what the conversation that never failed gives.
    assert _turn(failing, text).generation.text == _turn(steady, text).generation.text
    assert failing.window_first == steady.window_first


def test_the_window_passes_pinned_messages_by() -> None:
    from localchat.chat.window import WindowPolicy, plan_window

    counts = [("user", 50), ("assistant", 50), ("user", 50), ("assistant", 50), ("user", 30)]
    free = plan_window(10, counts, 0, 200, 20, WindowPolicy(drop_share=0.0))
    pinned = plan_window(
        10, counts, 0, 200, 20, WindowPolicy(drop_share=0.0), 0, [True, False, False, False]
    )
    assert (free.first, free.dropped_messages, free.dropped_tokens) == (2, 2, 100)
    # The pinned first question stays: its reply and the next exchange go instead.
    assert pinned.first == 4 and pinned.dropped_messages == 3 and pinned.dropped_tokens == 150
