"""A real model (SmolLM2-135M-Instruct: GPT-2-style BPE, ChatML with a default system prompt)
fed exactly as bare llama-cpp-python's chat path feeds it, resumed exactly, past its window,
and streaming Markdown in the app."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from textual.widgets import Markdown

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.widgets.chat_message import AssistantMessage
from tests.conftest import GREEDY

from .tui_helpers import chat_app

CODE_REQUEST = "Write a Python function that adds two numbers."


def _bare_chat_path(model: Path, messages: list[dict[str, str]], max_tokens: int):
    """llama-cpp-python alone: the GGUF's template rendered whole, tokenized once, greedy."""
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=2048, n_threads=2, verbose=False)
    try:
        template = llm.metadata["tokenizer.chat_template"]
        formatter = Jinja2ChatFormatter(
            template,
            eos_token=llm._model.token_get_text(llm.token_eos()),
            bos_token=llm._model.token_get_text(llm.token_bos()),
        )
        result = formatter(messages=messages)
        add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
        prompt = llm.tokenize(result.prompt.encode("utf-8"), add_bos=add_bos, special=True)
        reply: list[int] = []
        for token in llm.generate(prompt, temp=0.0):
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token) or len(reply) >= max_tokens:
                break
            reply.append(token)
        return prompt, reply
    finally:
        llm.close()


@pytest.mark.parametrize("with_system", [False, True])
def test_prompt_ids_and_greedy_reply_equal_llama_cpp_python(smollm2: Path, with_system) -> None:
    messages = [{"role": "user", "content": CODE_REQUEST}]
    if with_system:
        messages.insert(0, {"role": "system", "content": "You answer in one short paragraph."})
    expected_prompt, expected_reply = _bare_chat_path(smollm2, messages, 40)
    engine = Engine(smollm2, LoadOptions(n_ctx=2048, n_threads=2))
    try:
        prompt = engine.prompt_tokens([ChatMessage(m["role"], m["content"]) for m in messages])
        assert prompt == expected_prompt
        generation = engine.generate(prompt, GREEDY, 40)
        for _ in generation:
            pass
        assert generation.tokens == expected_reply
        assert generation.text.strip()
    finally:
        engine.close()


def _ask(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert main(["ask", *args, "--temperature", "0", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_resumed_conversation_continues_exactly_as_fresh(
    smollm2: Path, tmp_path: Path, isolated_home: Path, capsys, monkeypatch
) -> None:
    common = ["--model-path", str(smollm2), "--conversation", "py", "--max-tokens", "40"]
    first = _ask(capsys, CODE_REQUEST, *common)
    second = _ask(capsys, "Now make it subtract instead.", *common)
    assert second["stats"]["history_reevaluated_tokens"] == 0
    # History evaluated once: the second turn reads only its own message.
    assert second["stats"]["restored_from_state"] is True
    assert second["stats"]["prompt_tokens_evaluated"] < 30
    assert first["template"] == "the model's own"
    copy = tmp_path / "copy"
    shutil.copytree(isolated_home, copy)
    restored = _ask(capsys, "And multiply?", *common)
    monkeypatch.setenv("LOCALCHAT_HOME", str(copy))
    fresh = _ask(capsys, "And multiply?", *common, "--fresh")
    assert restored["stats"]["restored_from_state"] is True
    assert restored["stats"]["prompt_tokens_evaluated"] < 30
    assert fresh["stats"]["prompt_tokens_evaluated"] == fresh["stats"]["prompt_tokens"]
    assert restored["stats"]["prompt_tokens"] == fresh["stats"]["prompt_tokens"]
    assert restored["reply"] == fresh["reply"]


def test_the_window_moves_and_the_conversation_goes_on(smollm2: Path, tmp_path: Path) -> None:
    engine = Engine(smollm2, LoadOptions(n_ctx=384, n_threads=2))
    store = Store(tmp_path / "db.sqlite3")
    conversation = Conversation.open(store, StateStore(tmp_path / "states"), "long", engine)
    moved = []
    for i in range(12):
        turn = conversation.send(f"Tell me fact number {i} about Python.", GREEDY, 48)
        for _ in turn:
            pass
        assert turn.generation.text.strip()
        assert len(engine.cache.cached_tokens) < 384
        if turn.window.dropped_messages:
            moved.append(turn)
    assert moved and all(t.window.mode == "shift" for t in moved)
    # After a move the turn still reads only its new message.
    assert moved[-1].stats.prompt_tokens_evaluated < 40
    assert moved[-1].prompt.discarded == 0
    conversation.close()
    store.close()


async def test_the_app_streams_a_markdown_code_block(smollm2: Path) -> None:
    async with chat_app(smollm2, n_ctx=2048, max_tokens=60) as ui:
        finished = await ui.say(CODE_REQUEST)
        reply = ui.app.query_one(AssistantMessage)
        assert "```python" in reply.raw and "def " in reply.raw
        assert finished.stats.generated_tokens > 10
        markdown = reply.query_one(Markdown)
        fences = list(markdown.query("MarkdownFence"))
        assert fences, "the reply's code block is drawn as a code block"
        assert "template: the model's own" in ui.text("#model-info")
