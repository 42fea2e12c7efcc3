"""Attached files: put into the message under their name, refused in one line when they are
not text or cannot fit, and read once: the same files opening another conversation (or a
one-off ask) restore their evaluated state, with the same greedy reply."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.attachments import (
    Attachment,
    attachments_end,
    read_attachment,
    with_attachments,
)
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.conversation.prefix_states import ID_PREFIX
from localchat.errors import UsageError
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

CODE = "".join(f'def f{i}(x):\n    """Times {i}."""\n    return x * {i}\n\n' for i in range(30))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "funcs.py"
    path.write_text(CODE)
    return path


def test_files_open_the_message_fenced_under_their_names() -> None:
    tricky = Attachment("README.md", "Use it:\n```sh\nlocalchat\n```\nand ```` too\n")
    message = with_attachments("  what is this?", [Attachment("a.py", "x = 1\n"), tricky])
    assert message.startswith(
        "File: a.py\n```python\nx = 1\n```\n\nFile: README.md\n`````markdown\n"
    )
    assert message.endswith("\n`````\n\nwhat is this?")  # the user's words, from their first
    end = attachments_end(message)
    assert message[end:] == "what is this?"
    assert attachments_end("File: not really an attachment") == 0
    assert with_attachments("plain", []) == "plain"


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (None, "no such file"),
        (b"\x00\x01binary", "is not a text file"),
        (b"%PDF-1.7 ...", "is a PDF; attach its text instead"),
        (b"caf\xe9", "is not UTF-8 text (byte 3"),
    ],
)
def test_what_is_not_a_text_file_is_refused_in_one_line(
    tmp_path: Path, content: bytes | None, complaint: str
) -> None:
    path = tmp_path / "file.bin"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=re.escape(complaint)) as raised:
        read_attachment(path)
    assert "\n" not in str(raised.value)
    with pytest.raises(UsageError, match="is a folder"):
        read_attachment(tmp_path)


def test_a_file_larger_than_allowed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import localchat.chat.attachments as attachments

    monkeypatch.setattr(attachments, "MAX_ATTACHMENT_BYTES", 10)
    path = tmp_path / "log.txt"
    path.write_text("x" * 11)
    with pytest.raises(UsageError, match="attach a part of it"):
        read_attachment(path)


def _ask(
    capsys: pytest.CaptureFixture[str], model: Path, source: Path, question: str, *extra: str
) -> dict:
    argv = ["ask", question, "--attach", str(source), "--model-path", str(model)]
    argv += ["--temperature", "0", "--max-tokens", "12", "--ctx", "2048", "--json", *extra]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"attached {source.name}: " in captured.err
    result: dict = json.loads(captured.out)
    return result


def test_the_same_file_is_read_once_for_every_ask(
    tiny_model: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cold = _ask(capsys, tiny_model, source, "What does f3 do?")
    assert cold["stats"]["restored_prefix_tokens"] == 0
    warm = _ask(capsys, tiny_model, source, "What does f3 do?")
    assert warm["stats"]["restored_prefix_tokens"] > 500  # the file came from disk
    assert warm["stats"]["prompt_tokens_evaluated"] < 30
    assert warm["reply"] == cold["reply"]
    other = _ask(capsys, tiny_model, source, "And what about f7, then?")
    assert other["stats"]["restored_prefix_tokens"] == warm["stats"]["restored_prefix_tokens"]


def test_a_file_the_context_cannot_hold_is_refused_and_nothing_is_stored(
    tiny_model: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["ask", "sum it up", "--attach", str(source), "--model-path", str(tiny_model)]
    assert main([*argv, "--ctx", "256", "--conversation", "small"]) == 2
    err = capsys.readouterr().err
    assert "funcs.py with your message come to" in err and "use --ctx" in err
    assert Store(app_paths().database).find("small") is None


def test_a_new_conversation_opening_with_the_same_file_restores_it(
    tiny_model: Path, source: Path
) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=2048))
    paths = app_paths()
    store, states = Store(paths.database), StateStore(paths.states_dir)
    message = with_attachments("What does f3 do?", [read_attachment(source)])
    try:
        replies = []
        for name in ("first", "second"):
            engine.cache.reset()
            conversation = Conversation.open(store, states, name, engine)
            if name == "second":  # typed after attaching: the file is read meanwhile
                conversation.read_ahead(message[:-4], 12, lambda: False)
                assert [p for p in states.files() if p.name.startswith(ID_PREFIX)]
            turn = conversation.send(message, GREEDY, 12)
            for _ in turn:
                pass
            conversation.saver.wait()
            replies.append((turn.generation.text, turn.stats_dict()))
            conversation.close()
        (cold, cold_stats), (warm, warm_stats) = replies
        assert cold_stats["restored_prefix_tokens"] == 0
        assert warm_stats["restored_prefix_tokens"] > 500
        assert warm == cold
    finally:
        engine.close()
