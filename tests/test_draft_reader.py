"""Reading ahead while the conversation changes: pins, branch switches and edits made while
a message is being read ahead run between its steps (on the compute thread), so the turn
that finally sends the message has exactly the prompt and reply a fresh read gives."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.compute_thread import compute_waiting, run_compute
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.conversation.draft_reader import DraftReader
from localchat.conversation.local import Conversation
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

WAIT_S = 60.0


class SteppingReader(DraftReader):
    """A reader that, once armed, stops at its next step until another call waits for the
    compute thread: the change the test makes then lands between two steps for certain."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = threading.Event()
        self.at_step = threading.Event()

    def _give_way(self) -> bool:
        if self.armed.is_set():
            self.armed.clear()
            self.at_step.set()
            deadline = time.monotonic() + 10.0  # a change not run there never comes
            while not compute_waiting() and time.monotonic() < deadline:
                time.sleep(0.001)
        return super()._give_way()


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    loaded = run_compute(Engine, tiny_model, LoadOptions(n_ctx=2048))
    yield loaded
    run_compute(loaded.close)


def _answer(conversation: Conversation, text: str) -> None:
    for _ in run_compute(conversation.send, text, GREEDY, 8):
        pass


def _draft(topic: str) -> str:
    return " ".join(f"{topic} detail {i}: the figures and the reasons." for i in range(12))


def _with_branches(engine: Engine, name: str) -> tuple[Conversation, Store]:
    """Three questions answered, the last asked twice: two branches at message 5."""
    paths = app_paths()
    store = Store(paths.database)
    conversation = Conversation.open(store, StateStore(paths.states_dir), name, engine, "Hi.")
    for question in ("First question?", "Second question?", "Third question?"):
        _answer(conversation, question)
    run_compute(conversation.take_back_last_exchange)
    _answer(conversation, "Third question, asked again?")
    return conversation, store


def _changes(conversation: Conversation) -> list[tuple[str, object, tuple[object, ...]]]:
    """What the user does while typing: pin the first message, switch the last question's
    branch back, then edit the second question (each: the draft typed before it)."""

    def at(index: int) -> int:
        return conversation.exchanges[index].record.id

    return [
        (_draft("pinned"), conversation.pin, (lambda: at(0), True)),
        (_draft("switched"), conversation.switch_branch, (lambda: at(4), -1)),
        (_draft("edited"), conversation.branch_before, (lambda: at(2),)),
    ]


def _apply(change: object, args: tuple[object, ...]) -> None:
    assert callable(change)
    change(*(a() if callable(a) else a for a in args))


def _send(conversation: Conversation, text: str) -> tuple[list[int], str, int]:
    turn = run_compute(conversation.send, text, GREEDY, 16)
    for _ in turn:
        pass
    return turn.prompt.tokens, turn.generation.text, turn.restore.read_ahead


FINAL = _draft("edited") + " And the last word."


def test_pin_switch_and_edit_while_reading_ahead_leave_the_prompt_exact(engine: Engine) -> None:
    reference, reference_store = _with_branches(engine, "reference")
    for _draft_text, change, args in _changes(reference):
        _apply(change, args)
    expected_prompt, expected_reply, _ = _send(reference, FINAL)
    reference.close()
    reference_store.close()

    conversation, store = _with_branches(engine, "read-ahead")
    reader = SteppingReader()
    workers: list[threading.Thread] = []
    reports: list[tuple[str, int, int]] = []

    def record(conversation_id: str, tokens: int, kv_tokens: int) -> None:
        reports.append((conversation_id, tokens, kv_tokens))

    def offer(text: str) -> None:
        if reader.offer(conversation, text):
            workers.append(threading.Thread(target=reader.run, args=(64, record)))
            workers[-1].start()

    for draft, change, args in _changes(conversation):
        reader.at_step.clear()
        reader.armed.set()
        offer(draft)
        assert reader.at_step.wait(WAIT_S), "reading ahead never reached a step"
        _apply(change, args)  # from this thread: it waits for the compute thread's next step
    offer(FINAL)
    for worker in workers:
        worker.join(WAIT_S)
    assert not reader.running
    assert reader.steps_given_way >= 3  # each change came between two steps of reading
    assert reports and reports[-1][1] > 0  # the final text was read ahead
    prompt, reply, read_ahead = _send(conversation, FINAL)
    assert read_ahead > 0  # and used by the turn
    assert [e.record.content for e in conversation.exchanges[:3:2]] == ["First question?", FINAL]
    # Exactly the prompt and the reply of the same changes made with nothing read ahead.
    assert prompt == expected_prompt
    assert reply == expected_reply
    conversation.close()
    store.close()
