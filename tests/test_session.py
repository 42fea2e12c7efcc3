"""Multi-turn chat on one engine: each turn evaluates only what is new."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.engine import Engine, LoadOptions, Sampling
from localchat.prompt import PromptMessage
from localchat.session import ChatSession

GREEDY = Sampling(temperature=0.0)


@pytest.fixture
def engine(tiny_model: Path) -> Engine:
    return Engine(tiny_model, LoadOptions(n_ctx=1024))


def _turn(session: ChatSession, text: str, max_tokens: int = 12):
    turn = session.send(text, GREEDY, max_tokens)
    for _ in turn:
        pass
    return turn


def test_second_turn_evaluates_only_the_new_message(engine: Engine) -> None:
    session = ChatSession(engine, system_prompt="You are terse.")
    first = _turn(session, "hello there")
    second = _turn(session, "tell me more")
    assert first.reply is not None and first.reply.tokens is not None
    # The reply's recorded ids contain the generated ids verbatim.
    generated = first.generation.tokens
    ids = first.reply.tokens
    assert any(ids[i : i + len(generated)] == generated for i in range(len(ids)))
    # The second prompt starts with the first prompt and the reply exactly.
    assert second.prompt.tokens[: len(first.prompt.tokens)] == first.prompt.tokens
    held = len(first.prompt.tokens) + len(generated) - 1
    assert second.stats.prompt_tokens_evaluated == len(second.prompt.tokens) - held
    # That is: the last generated token, the reply's closing, the new message, the header.
    new_text = "<|im_end|>\n<|im_start|>user\ntell me more<|im_end|>\n<|im_start|>assistant\n"
    expected = 1 + len(engine.tokenize(new_text, special=True))
    assert second.stats.prompt_tokens_evaluated == expected
    assert [m.role for m in session.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


def test_prompt_segments_render_the_same_text_as_the_whole_template(engine: Engine) -> None:
    builder = engine.prompt_builder()
    messages = [
        PromptMessage("system", "sys"),
        PromptMessage("user", "question"),
        PromptMessage("assistant", "answer"),
        PromptMessage("user", "again"),
    ]
    segments = builder.segments(messages)
    assert segments is not None
    whole = builder.template.render([m.as_chat() for m in messages], add_generation_prompt=False)
    assert "".join(segments) == whole


def test_a_failed_send_leaves_no_user_message(engine: Engine) -> None:
    session = ChatSession(engine)
    with pytest.raises(Exception, match="context holds"):
        session.send("word " * 2000)
    assert session.messages == []


def test_cancelled_reply_is_kept_and_marked(engine: Engine) -> None:
    import threading

    cancel = threading.Event()
    session = ChatSession(engine)
    turn = session.send("go", GREEDY, 100, cancel)
    for count, _delta in enumerate(turn, start=1):
        if count == 3:
            cancel.set()
    assert turn.cancelled
    assert turn.reply is not None and turn.reply.content == turn.generation.text
    assert turn.generation.stats.generated_tokens == 3
