"""Chat templates as real models ship them: the constructs llama.cpp's template engine
handles, the polyfills it applies, and cache reuse when a template rewrites history.

The templates in tests/templates are written for these tests in the styles of Llama 3.x,
Gemma 2, Phi-3.5, Mistral Nemo and Qwen3 (ChatML control tokens, so the demo model's
vocabulary parses them).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.formats import BUILTIN, PLAIN, detect_format
from localchat.chat.template import ChatMessage, ChatTemplate
from localchat.conversation.local import Conversation
from localchat.errors import ModelFileError, UsageError
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

from .gguf_edit import rewrite_metadata

TEMPLATES = Path(__file__).parent / "templates"
DAY = datetime(2025, 3, 4, 12, 0)


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), "<s>", "</s>", name)


def _conversation(n: int, system: bool) -> list[ChatMessage]:
    messages = [ChatMessage("system", "  Be brief.  ")] if system else []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append(ChatMessage(role, f"message {i} ünïcode"))
    return messages


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.jinja")))
@pytest.mark.parametrize("system", [False, True])
def test_every_template_renders_conversations_of_1_to_12_messages(name: str, system) -> None:
    template = _template(name)
    for n in range(1, 13):
        messages = _conversation(n, system)
        text = template.render(messages, True, DAY)
        for message in messages:
            # Mistral Nemo writes the system prompt only into a last user turn.
            dropped = name == "system_last.jinja" and messages[-1].role != "user"
            if not (message.role == "system" and dropped):
                assert message.content.strip() in text
        assert text.endswith(("assistant\n", "model\n", "assistant\n<think>\n"))
        closed = template.render(messages, False, DAY)
        assert not closed.endswith("assistant\n")


def test_the_date_is_the_one_given_and_messages_zero_is_read() -> None:
    text = _template("header_style.jinja").render(_conversation(1, True), True, DAY)
    assert text.startswith("<s><|im_start|>system\nToday Date: 04 Mar 2025\nBe brief.<|im_end|>")
    assert text.count("Be brief.") == 1  # the system message left the loop (messages[1:])


def test_tojson_keeps_unicode_and_takes_indent() -> None:
    source = "{{ {'name': 'café <b>', 'n': [1, 2]} | tojson(indent=2) }}"
    text = ChatTemplate(source).render([ChatMessage("user", "x")])
    assert json.loads(text) == {"name": "café <b>", "n": [1, 2]}
    assert "café <b>" in text and '\n  "n"' in text


def test_raise_exception_becomes_a_one_line_error() -> None:
    template = _template("header_style.jinja")
    with pytest.raises(ModelFileError, match="failed: Unknown role narrator"):
        template.render([ChatMessage("user", "a"), ChatMessage("narrator", "b")])


def test_a_template_without_a_system_role_gets_it_folded_into_the_first_user_message() -> None:
    template = _template("no_system.jinja")
    assert not template.caps.supports_system_role
    assert template.caps.requires_alternation
    text = template.render(_conversation(3, True), True, DAY)
    assert text.startswith("<s><|im_start|>user\nBe brief.  \nmessage 0 ünïcode<|im_end|>")
    # Two user messages in a row are merged: the roles alternate as the template demands.
    merged = template.render([ChatMessage("user", "one"), ChatMessage("user", "two")])
    assert "one\n\ntwo" in merged


def test_a_template_that_drops_the_system_role_silently_gets_it_folded() -> None:
    source = (
        "{% for m in messages %}{% if m.role != 'system' %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert not template.caps.supports_system_role
    text = template.render([ChatMessage("system", "rules"), ChatMessage("user", "hi")])
    assert "rules\nhi" in text


def test_builtin_formats_and_detection() -> None:
    assert detect_format(lambda marker: marker.startswith("<|im_")) is BUILTIN["chatml"]
    assert detect_format(lambda marker: marker in ("[INST]", "[/INST]")) is BUILTIN["mistral"]
    assert detect_format(lambda marker: False) is PLAIN
    for chat_format in BUILTIN.values():
        template = ChatTemplate(chat_format.source, "<s>", "</s>", chat_format.name)
        for n in range(1, 7):
            assert template.render(_conversation(n, True), True, DAY)


# -- on a model: cache reuse with templates that are not strictly incremental -------------


def _open(tmp_path: Path, model: Path, template: str | None, system: str | None = None):
    engine = Engine(model, LoadOptions(n_ctx=1024, template=template))
    store = Store(tmp_path / "db.sqlite3")
    conversation = Conversation.open(store, StateStore(tmp_path / "states"), "c", engine, system)
    return conversation


def _turn(conversation: Conversation, text: str):
    turn = conversation.send(text, GREEDY, 12)
    for _ in turn:
        pass
    return turn


@pytest.mark.parametrize("name", ["eos_when_closed.jinja", "header_style.jinja"])
def test_next_turn_evaluates_only_the_new_message(tmp_path: Path, tiny_model: Path, name) -> None:
    conversation = _open(tmp_path, tiny_model, str(TEMPLATES / name), "Be brief.")
    assert conversation.backend.template.name == f"{name} (chosen)"
    first = _turn(conversation, "hello there")
    conversation.close()
    conversation.store.close()
    # Reopened (a new process would do the same): restored, and only the new message read.
    reopened = _open(tmp_path, tiny_model, str(TEMPLATES / name))
    second = _turn(reopened, "tell me more")
    held = len(first.prompt.tokens) + len(first.generation.tokens)
    assert second.restore.restored
    assert second.prompt.discarded == 0
    assert second.stats.prompt_tokens_evaluated == len(second.prompt.tokens) - held
    assert second.stats.prompt_tokens_evaluated < 30
    reopened.close()


def test_a_dated_template_reads_the_conversations_first_day(
    tmp_path: Path, tiny_model: Path
) -> None:
    conversation = _open(tmp_path, tiny_model, str(TEMPLATES / "header_style.jinja"))
    started = datetime(2024, 2, 29, 9, 30)
    conversation.store.db.execute("UPDATE conversations SET created_at = ?", (started.timestamp(),))
    conversation.store.db.commit()
    conversation.close()
    conversation.store.close()
    reopened = _open(tmp_path, tiny_model, str(TEMPLATES / "header_style.jinja"))
    turn = _turn(reopened, "hello")
    text = reopened.builder.render(turn.messages)
    assert "Today Date: 29 Feb 2024" in text
    reopened.close()


def test_a_template_that_moves_the_system_prompt_reports_what_it_re_read(
    tmp_path: Path, tiny_model: Path
) -> None:
    conversation = _open(tmp_path, tiny_model, str(TEMPLATES / "system_last.jinja"), "Rules.")
    first = _turn(conversation, "hello there")
    second = _turn(conversation, "tell me more")
    # The system prompt left the first user turn: everything from there is re-read.
    assert second.prompt.discarded > 0
    assert "message 2 (user)" in (second.prompt.discarded_reason or "")
    stats = second.stats_dict()
    assert stats["history_reevaluated_tokens"] == second.prompt.discarded
    assert stats["history_reevaluated_reason"] == second.prompt.discarded_reason
    # Only from the first token that differs: the BOS and the user header stay.
    assert 0 < second.prompt.reused < len(first.prompt.tokens)
    assert second.stats.prompt_tokens_evaluated == len(second.prompt.tokens) - second.prompt.reused
    conversation.close()
    conversation.store.close()


def test_reasoning_stripped_from_earlier_replies_is_reported(tiny_model: Path) -> None:
    engine = Engine(
        tiny_model, LoadOptions(n_ctx=1024, template=str(TEMPLATES / "reasoning.jinja"))
    )
    builder = engine.prompt_builder(DAY)
    question = [ChatMessage("user", "what is 2+2?")]
    first = builder.build(question)
    reply = "<think>\nadd them\n</think>\n\nfour"
    held = first.tokens + engine.tokenize(reply, special=True)
    second = builder.build(
        [*question, ChatMessage("assistant", reply), ChatMessage("user", "and 3+3?")], held
    )
    assert second.reused >= len(first.tokens)
    assert second.discarded > 0
    assert "message 2 (assistant)" in (second.discarded_reason or "")
    whole = builder.tokens_of(
        builder.render(
            [*question, ChatMessage("assistant", reply), ChatMessage("user", "and 3+3?")]
        )
    )
    assert "<think>" not in engine.detokenize(second.tokens[second.reused :])
    assert (
        second.tokens[second.reused :] == whole[len(whole) - (len(second.tokens) - second.reused) :]
    )


def _without_template(source: Path, dest: Path) -> Path:
    return rewrite_metadata(source, dest, remove=("tokenizer.chat_template",))


def test_a_chat_model_without_a_template_gets_the_format_its_vocabulary_names(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Its end token, ``<|im_end|>``, says it was tuned for chat (tests/test_base_models.py
    has the base models, which get the plain transcript whatever their vocabulary holds)."""
    bare = _without_template(tiny_model, tmp_path / "no-template.gguf")
    engine = Engine(bare, LoadOptions(n_ctx=256))
    assert engine.info.chat_template is None
    expected = "chatml (no template in the file; chat-tuned: end token `<|im_end|>`)"
    assert engine.template.name == expected
    prompt = engine.prompt_tokens([ChatMessage("user", "hi")])
    spelled = b"".join(engine.token_bytes(t) for t in prompt)
    assert spelled == b"<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    engine.close()


def test_a_transcript_model_stops_where_the_users_next_turn_begins(
    tmp_path: Path, smollm2: Path
) -> None:
    """A model on the plain transcript format (as a base model without a template gets it)
    starts writing "User: …" itself; the reply ends there and says why."""
    conversation = _open(tmp_path, smollm2, "plain")
    assert conversation.backend.template.stop == PLAIN.stop
    stopped = []
    after_stop = []
    previous = None
    for question in ("Hi!", "What is 2+2?", "And 3+3?", "Thanks. What is 5+5?"):
        turn = conversation.send(question, GREEDY, 100)
        deltas = [d.text for d in turn]
        assert "".join(deltas) == turn.generation.text
        if stopped and stopped[-1] is previous:
            after_stop.append(turn)
        if turn.stats.stop_reason == "stop":
            stopped.append(turn)
            # The cache holds the reply up to the stop, not the tokens that spelled it.
            held = conversation.backend.cache.cached_tokens
            assert held == turn.prompt.tokens + turn.generation.tokens
            assert turn.stats.generated_tokens >= len(turn.generation.tokens)
        assert "\nUser:" not in turn.generation.text
        assert turn.prompt.discarded <= 3  # replies re-render as generated
        previous = turn
    assert after_stop and all(t.prompt.discarded == 0 for t in after_stop)
    assert stopped, "no reply reached the user's next turn"
    record = conversation.store.messages(conversation.record.id)[-1]
    assert record.status == "complete"
    conversation.close()
    conversation.store.close()


def test_an_unknown_template_name_is_a_clear_error(tiny_model: Path) -> None:
    with pytest.raises(UsageError, match="unknown template 'nope'; use one of chatml"):
        Engine(tiny_model, LoadOptions(n_ctx=256, template="nope"))


def _catalog_entry(file_name: str, template: str) -> str:
    return f"""
[[model]]
name = "mine"
repo = "me/mine-GGUF"
architecture = "llama"
n_layer = 2
n_embd = 128
n_head = 4
n_head_kv = 2
head_dim = 32
n_vocab = 1024
context_length = 4096
template = "{template}"
[model.files]
Q4_K_M = {{ file = "{file_name}", size = 1000 }}
"""


def test_a_catalog_entry_names_the_template(tiny_model: Path, capsys) -> None:
    from localchat.cli.main import main
    from localchat.paths import app_paths

    catalog = app_paths().user_catalog
    catalog.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_text(_catalog_entry(tiny_model.name, "plain"))
    args = ["ask", "hi", "--model-path", str(tiny_model), "--max-tokens", "2", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["template"] == "plain (chosen)"
    # --template still wins over the catalog.
    assert main([*args, "--template", "chatml"]) == 0
    assert json.loads(capsys.readouterr().out)["template"] == "chatml (chosen)"
    # A file beside the catalog, named relatively.
    (catalog.parent / "mine.jinja").write_text((TEMPLATES / "eos_when_closed.jinja").read_text())
    catalog.write_text(_catalog_entry(tiny_model.name, "mine.jinja"))
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["template"] == "mine.jinja (chosen)"


def test_a_bad_catalog_template_field_names_the_entry(tmp_path: Path) -> None:
    from localchat.models.catalog import CatalogError, load_catalog_file

    path = tmp_path / "models.toml"
    path.write_text(_catalog_entry("x.gguf", "").replace('template = ""', "template = 3"))
    with pytest.raises(CatalogError, match=r"model 'mine': field 'template' must be"):
        load_catalog_file(path)
