"""The one tool loop (``tools.loop``): its rules hold whoever supplies the hooks. The
command line's and the app's hooks are tested end to end on a real model in
tests/test_ask_tools.py and tests/test_tui_tools.py; here the rules each of them relies on."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from localchat.chat.template import ChatMessage
from localchat.chat.tools import NOT_RUN, ToolCall
from localchat.tools.consent import DENIED_RESULT, MAX_ROUNDS, STOPPED, STOPPED_RESULT
from localchat.tools.loop import STOPPED_BY_USER, ToolLoop, chain
from localchat.tools.results import ToolResult


@dataclass
class Hooks:
    """Allows the names in ``allowed``; runs a call by echoing its name."""

    allowed: set[str]
    refusal_ends: bool = False
    ran: list[str] = field(default_factory=list)
    shown: list[tuple[str, str | None]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    cancel_on_run: threading.Event | None = None
    fail_on: str | None = None

    def allow(self, call: ToolCall) -> bool:
        return call.name in self.allowed

    def run(self, call: ToolCall) -> ToolResult:
        if call.name == self.fail_on:
            raise RuntimeError("the tool's server went away")
        self.ran.append(call.name)
        if self.cancel_on_run is not None:
            self.cancel_on_run.set()
        return ToolResult(f"{call.name} done")

    def answered(self, call: ToolCall, result: ToolResult | None) -> None:
        self.shown.append((call.name, None if result is None else result.text))

    def stopped(self, line: str) -> None:
        self.said.append(line)


def _calls(*names: str) -> list[ToolCall]:
    return [ToolCall(name, {}, f"id{i}{name}") for i, name in enumerate(names)]


def _texts(results: list[ChatMessage]) -> list[str]:
    return [m.content for m in results]


def test_each_call_gets_one_result_in_order_and_a_refused_one_tells_the_model() -> None:
    hooks = Hooks({"a", "c"})
    calls = _calls("a", "b", "c")
    answer = ToolLoop(hooks).answer(calls)
    assert answer.go_on
    assert [m.tool_call_id for m in answer.results] == [c.id for c in calls]
    assert _texts(answer.results) == ["a done", DENIED_RESULT, "c done"]
    assert hooks.ran == ["a", "c"]
    assert hooks.shown == [("a", "a done"), ("b", None), ("c", "c done")]


def test_where_a_refusal_ends_the_loop_no_call_of_its_round_runs() -> None:
    hooks = Hooks({"a", "c"}, refusal_ends=True)
    loop = ToolLoop(hooks)
    answer = loop.answer(_calls("a", "b", "c"))
    assert not answer.go_on
    assert hooks.ran == []
    assert _texts(answer.results) == [DENIED_RESULT] * 3
    assert [c.name for c in loop.refused] == ["a", "b", "c"]


def test_a_stop_during_a_round_answers_the_calls_left_as_stopped() -> None:
    cancel = threading.Event()
    hooks = Hooks({"a", "b"}, cancel_on_run=cancel)
    answer = ToolLoop(hooks, cancel).answer(_calls("a", "b"))
    assert not answer.go_on
    assert hooks.ran == ["a"]
    assert _texts(answer.results) == ["a done", f"error: {STOPPED_BY_USER}"]


def test_a_hook_that_raises_ends_the_round_with_every_call_answered() -> None:
    hooks = Hooks({"a", "b", "c"}, fail_on="b")
    answer = ToolLoop(hooks).answer(_calls("a", "b", "c"))
    assert not answer.go_on and isinstance(answer.error, RuntimeError)
    assert _texts(answer.results) == ["a done", NOT_RUN, NOT_RUN]


@dataclass
class Replies:
    """Replies that call ``names`` in turn, then answer in words."""

    script: list[list[str]]
    kept: list[list[ChatMessage]] = field(default_factory=list)
    read: list[list[ChatMessage]] = field(default_factory=list)

    def calls(self, reply: int) -> Sequence[ToolCall]:
        return _calls(*self.script[reply]) if reply < len(self.script) else []

    def next_reply(self, reply: int, results: list[ChatMessage]) -> int:
        assert reply == len(self.read)  # the reply whose calls these answer
        self.read.append(results)
        return len(self.read)

    def keep(self, results: list[ChatMessage]) -> None:
        self.kept.append(results)


def test_the_chain_feeds_results_back_until_a_reply_calls_nothing() -> None:
    replies = Replies([["a"], ["a", "a"]])
    seen = list(chain(ToolLoop(Hooks({"a"})), replies, 0))
    assert seen == [0, 1, 2]
    assert [_texts(r) for r in replies.read] == [["a done"], ["a done", "a done"]]
    assert replies.kept == []


def test_the_chain_stops_after_the_round_limit_and_keeps_the_calls_answered() -> None:
    hooks = Hooks({"a"})
    replies = Replies([["a"]] * (MAX_ROUNDS + 5))
    seen = list(chain(ToolLoop(hooks), replies, 0))
    assert len(seen) == MAX_ROUNDS + 1
    assert hooks.said == [STOPPED]
    assert [_texts(r) for r in replies.kept] == [[STOPPED_RESULT]]


def test_the_chain_ends_where_the_caller_stops_reading_or_cancels() -> None:
    cancel = threading.Event()
    replies = Replies([["a"], ["a"]])
    for reply in chain(ToolLoop(Hooks({"a"}), cancel), replies, 0):
        cancel.set()  # Ctrl-C while the first reply streamed
        assert reply == 0
    assert replies.read == [] and replies.kept == []


def test_a_refused_call_is_kept_answered_when_the_refusal_ends_the_chain() -> None:
    replies = Replies([["b"]])
    seen = list(chain(ToolLoop(Hooks(set(), refusal_ends=True)), replies, 0))
    assert seen == [0]
    assert [_texts(r) for r in replies.kept] == [[DENIED_RESULT]]


def test_the_chain_keeps_the_answered_calls_then_raises_what_a_hook_raised() -> None:
    replies = Replies([["a", "b"]])
    with pytest.raises(RuntimeError):
        list(chain(ToolLoop(Hooks({"a", "b"}, fail_on="b")), replies, 0))
    assert [_texts(r) for r in replies.kept] == [["a done", NOT_RUN]]
