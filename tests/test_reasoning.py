"""Reasoning replies: the <think> block streams apart from the answer, is reported apart by
`ask --json`, shown dimmed and collapsible in the app, and left out of exports unless asked."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from textual.widgets import Collapsible, Markdown, Static

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.reasoning import ReasoningStream, opens_reasoning, split_reasoning
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.state.export import export_json, export_markdown
from localchat.state.store import Store
from localchat.tui.widgets.chat_message import AssistantMessage
from tests.conftest import GREEDY

from .tui_helpers import chat_app

OPENS = str(Path(__file__).parent / "templates" / "opens_thinking.jinja")
REPLY = "<think>\nFirst add 2 and 2.\nThat is 4.\n</think>\n\nThe answer is **4**."


def _streamed(text: str, seed: int, opened: bool = False) -> tuple[str, str]:
    """Feed ``text`` in random pieces; return (reasoning, answer) as streamed."""
    rng = random.Random(seed)
    stream = ReasoningStream(opened)
    parts: list[tuple[bool, str]] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 6)
        parts += stream.feed(text[i : i + n])
        i += n
    parts += stream.flush()
    return "".join(t for r, t in parts if r), "".join(t for r, t in parts if not r)


def test_split_and_stream_agree_however_the_text_is_cut() -> None:
    assert split_reasoning(REPLY) == ("First add 2 and 2.\nThat is 4.", "The answer is **4**.")
    for seed in range(200):
        thought, answer = _streamed(REPLY, seed)
        assert thought.strip("\n") == "First add 2 and 2.\nThat is 4."
        assert answer == "The answer is **4**."


def test_replies_without_reasoning_pass_through() -> None:
    for text in ("plain answer", "  <b>bold</b> start", "<thin", "a <think> inside is text"):
        assert split_reasoning(text) == ("", text)
        for seed in range(20):
            assert _streamed(text, seed) == ("", text)


def test_a_block_opened_by_the_prompt_and_an_unfinished_one() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert split_reasoning("thinking…\n</think>\n\nanswer", opened=True) == ("thinking…", "answer")
    assert _streamed("thinking…\n</think>\n\nanswer", 3, opened=True) == ("thinking…\n", "answer")
    assert split_reasoning("<think>still going") == ("still going", "")
    # A stored reply whose prompt opened the block still splits.
    assert split_reasoning("thought</think>\n\nanswer") == ("thought", "answer")


def test_ask_json_reports_the_reasoning_apart(tiny_model: Path, capsys) -> None:
    args = ["ask", "hi", "--model-path", str(tiny_model), "--template", OPENS]
    assert main([*args, "--temperature", "0", "--max-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # The template opened the block and the random model never closes it: all thinking.
    assert result["reasoning"] and result["reply"] == ""
    engine = Engine(tiny_model, LoadOptions(n_ctx=512))
    plain = engine.generate(engine.prompt_tokens([ChatMessage("user", "hi")]), GREEDY, 4)
    list(plain)
    assert plain.reasoning == "" and plain.answer == plain.text


def test_a_streamed_reply_inside_the_block_yields_reasoning_deltas(tiny_model: Path) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=512, template=OPENS))
    generation = engine.generate(engine.prompt_tokens([ChatMessage("user", "hi")]), GREEDY, 12)
    deltas = list(generation)
    assert generation.opened_reasoning
    assert deltas and all(d.reasoning for d in deltas if d.text)
    assert "".join(d.text for d in deltas) == generation.text  # no tags in this reply
    assert generation.reasoning == generation.text.strip("\n")


def _stored(tmp_path: Path) -> tuple[Store, str]:
    store = Store(tmp_path / "db.sqlite3")
    record = store.create_conversation("math", None, "m.gguf")
    store.add_message(record.id, "user", "what is 2+2?")
    store.add_message(record.id, "assistant", REPLY)
    return store, record.id


def test_exports_leave_the_reasoning_out_unless_asked(tmp_path: Path) -> None:
    store, conversation_id = _stored(tmp_path)
    record = store.get("math")
    messages = store.messages(conversation_id)
    markdown = export_markdown(record, messages)
    assert "The answer is **4**." in markdown and "First add" not in markdown
    assert "First add 2 and 2." in export_markdown(record, messages, reasoning=True)
    rows = json.loads(export_json(record, messages))["messages"]
    assert rows[1]["content"] == "The answer is **4**." and "reasoning" not in rows[1]
    rows = json.loads(export_json(record, messages, reasoning=True))["messages"]
    assert rows[1]["reasoning"] == "First add 2 and 2.\nThat is 4."
    store.close()


async def test_the_app_shows_reasoning_dimmed_and_collapsible(
    tiny_model: Path, isolated_home: Path
) -> None:
    from localchat.paths import app_paths

    store = Store(app_paths().database)
    record = store.create_conversation("math", None, tiny_model.name)
    store.add_message(record.id, "user", "what is 2+2?")
    store.add_message(record.id, "assistant", REPLY)
    store.close()
    async with chat_app(
        tiny_model, n_ctx=512, max_tokens=12, conversation_name="math", template=OPENS
    ) as ui:
        app = ui.app

        def stored_shown() -> bool:  # mounted, with its children (later on a busy machine)
            found = app.query(AssistantMessage)
            if not found or not found.first().query(Markdown):
                return False
            reasoning = found.first().query(".reasoning-text")
            return bool(reasoning) and "First add" in str(reasoning.first(Static).render())

        await ui.until(stored_shown, "the stored reply is shown")
        stored = app.query(AssistantMessage).first()
        assert stored.raw == "The answer is **4**."
        assert stored.markdown.source == "The answer is **4**."
        block = stored.query_one(Collapsible)
        assert block.display and block.collapsed
        assert "First add 2 and 2." in str(stored.query_one(".reasoning-text", Static).render())
        # A new reply inside an opened block streams into the reasoning, not the answer.
        await ui.say("and 3+3?")
        live = app.query(AssistantMessage).last()
        assert live.reasoning.strip() and live.raw == ""
        assert len(live.query(Collapsible)) == 1  # one block, however many chunks it took
        assert live.query_one(Collapsible).display
        assert not live.query_one(Collapsible).collapsed  # nothing else to read yet


@pytest.mark.parametrize("flag", [[], ["--reasoning"]])
def test_export_command_takes_reasoning(tmp_path: Path, isolated_home: Path, capsys, flag) -> None:
    from localchat.paths import app_paths

    app_paths().database.parent.mkdir(parents=True, exist_ok=True)
    store = Store(app_paths().database)
    record = store.create_conversation("math", None, "m.gguf")
    store.add_message(record.id, "assistant", REPLY)
    store.close()
    assert main(["export", "math", *flag]) == 0
    out = capsys.readouterr().out
    assert ("First add" in out) == bool(flag)
