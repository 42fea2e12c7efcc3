"""For every tokenizer kind llama.cpp has: the first prompt is token for token what
llama-cpp-python's own chat path gives (template rendered whole, tokenized once), and a
saved conversation's next turn evaluates only its new message."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.template import ChatMessage
from localchat.conversation.local import Conversation
from localchat.models.demo import TOKENIZERS, make_demo_model
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

TEXTS = [
    "hello",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "two  spaces  inside",
    "line one\nline two\n\nline four",
    "\nstarts with a newline",
    "tabs\tand\ttabs",
    "numbers 2024 and 3.14159 and 1,000,000",
    "ünïcödé, 日本語, emoji 🙂",
    "code: def f(x):\n    return x * 2\n",
    "punctuation!?… «quotes» (brackets) [more] {braces}",
    "ALL CAPS AND MixedCase words",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "'single' and \"double\" quotes",
    "x" * 60,
    "ends with newline\n",
]


@pytest.fixture(scope="module", params=TOKENIZERS)
def kind_model(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(f"tok-{request.param}")
    return make_demo_model(
        directory / "model.gguf", "tiny", "Q4_K_M", seed=0, tokenizer=request.param
    )


def _reference(model: Path, messages: list[dict[str, str]]) -> list[int]:
    """llama-cpp-python's chat path: its Jinja formatter, one tokenize call, BOS per vocab."""
    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    formatter = Jinja2ChatFormatter(
        llm.metadata["tokenizer.chat_template"],
        eos_token=llm._model.token_get_text(llm.token_eos()),
        bos_token=llm._model.token_get_text(llm.token_bos()),
    )
    prompt = formatter(messages=messages).prompt
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
    return llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)


def test_first_turn_prompt_ids_equal_whole_prompt_tokenization(kind_model: Path) -> None:
    engine = Engine(kind_model, LoadOptions(n_ctx=1024))
    for i, text in enumerate(TEXTS):
        messages = [{"role": "user", "content": text}]
        if i % 2:
            messages.insert(0, {"role": "system", "content": TEXTS[-1 - i]})
        chat = [ChatMessage(m["role"], m["content"]) for m in messages]
        assert engine.prompt_tokens(chat) == _reference(kind_model, messages), text
    engine.close()


def test_next_turns_evaluate_only_the_new_message(kind_model: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    states = StateStore(tmp_path / "states")
    previous = None
    strict = 0
    for text in TEXTS[:8]:
        # A new process every other turn: the state is restored from disk, not kept warm.
        engine = Engine(kind_model, LoadOptions(n_ctx=1024))
        conversation = Conversation.open(store, states, "c", engine, "Be brief.")
        turn = conversation.send(text, GREEDY, 10)
        for _ in turn:
            pass
        if previous is not None:
            held = previous.prompt.tokens + previous.generation.tokens
            spelled = b"".join(engine.token_bytes(t) for t in previous.generation.tokens)
            if spelled.decode("utf-8", errors="replace") != previous.generation.text:
                # A random-weight reply that stopped inside a UTF-8 character: its text
                # lacks those bytes, so only its last tokens are read again.
                assert turn.prompt.reused >= len(held) - 4, text
                previous = turn
                conversation.close()
                engine.close()
                continue
            strict += 1
            assert turn.prompt.tokens[: len(held)] == held, text
            assert turn.prompt.discarded == 0, text
            assert turn.stats.prompt_tokens_evaluated == len(turn.prompt.tokens) - len(held)
            # The new tokens are what whole-prompt tokenization gives for the new text.
            whole = conversation.builder.tokens_of(conversation.builder.render(turn.messages))
            new = turn.prompt.tokens[len(held) :]
            assert whole[len(whole) - len(new) :] == new, text
            assert turn.restore.restored
        previous = turn
        conversation.close()
        engine.close()
    store.close()
    assert strict >= 3
