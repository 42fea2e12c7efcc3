"""Conversations that resume from a saved KV cache, across real processes.

The continuation after a restore must be token-identical (greedy) to the same turn in a
process that never closed and to a --fresh re-evaluation; every kind of bad state file must
fall back to re-evaluation with a notice, never a crash or a different reply.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.conversation.local import Conversation
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.locks import ConversationInUse
from localchat.state.store import Store
from tests.conftest import GREEDY

FIRST, SECOND = "Tell me about caches.", "And what about windows?"
GREEDY_ARGS = ("--temperature", "0", "--max-tokens", "24")


def ask(model: Path, conversation: str, message: str, *extra: str, env: dict | None = None) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "localchat.cli.main",
            "ask",
            message,
            "--model-path",
            str(model),
            "--conversation",
            conversation,
            "--json",
            *GREEDY_ARGS,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    payload["stderr"] = result.stderr
    return payload


def _state_file(conversation: str) -> Path:
    store = Store(app_paths().database)
    record = store.get(conversation)
    store.close()
    files = list(app_paths().states_dir.glob(f"{record.id}.*.lckv"))
    assert len(files) == 1
    return files[0]


def _warm_reply(model: Path, kv_type: str = "f16") -> str:
    """The second turn in a process that never closed."""
    engine = Engine(model, LoadOptions(n_ctx=4096, kv_type=kv_type))
    store = Store(app_paths().database)
    conversation = Conversation.open(store, StateStore(app_paths().states_dir), "warm", engine)
    for text in (FIRST, SECOND):
        turn = conversation.send(text, GREEDY, 24)
        for _ in turn:
            pass
    assert not turn.restore.restored
    conversation.close()
    return turn.generation.text


def test_resume_in_a_new_process_is_token_identical_to_warm_and_fresh(small_model: Path) -> None:
    # The small shape: there a plain batched re-evaluation differs from the cache in the last
    # bits (see test_engine), so --fresh must replay the original batches to match.
    ask(small_model, "resumed", FIRST)
    resumed = ask(small_model, "resumed", SECOND)
    ask(small_model, "fresh", FIRST)
    fresh = ask(small_model, "fresh", SECOND, "--fresh")
    warm = _warm_reply(small_model)

    assert resumed["reply"] == fresh["reply"] == warm
    stats = resumed["stats"]
    assert stats["restored_from_state"] is True
    # Only the new message (and the last reply token, template tokens) was evaluated.
    assert stats["prompt_tokens_evaluated"] < 30 < stats["prompt_tokens"]
    assert stats["restored_tokens"] == stats["prompt_tokens"] - stats["prompt_tokens_evaluated"]
    assert fresh["stats"]["restored_from_state"] is False
    assert fresh["stats"]["prompt_tokens_evaluated"] == fresh["stats"]["prompt_tokens"]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


@pytest.mark.parametrize(
    ("damage", "notice"),
    [(_corrupt, "checksum mismatch"), (_truncate, "truncated file")],
)
def test_damaged_state_falls_back_to_the_same_reply(tiny_model: Path, damage, notice: str) -> None:
    ask(tiny_model, "ref", FIRST)
    reference = ask(tiny_model, "ref", SECOND, "--fresh")
    ask(tiny_model, "damaged", FIRST)
    damage(_state_file("damaged"))
    result = ask(tiny_model, "damaged", SECOND)
    assert result["reply"] == reference["reply"]
    assert result["stats"]["restored_from_state"] is False
    assert any(notice in n for n in result["notices"])
    assert notice in result["stderr"]


def test_state_of_another_model_is_not_used(tiny_model: Path, tiny_model_other_seed: Path) -> None:
    ask(tiny_model, "mine", FIRST)
    ask(tiny_model_other_seed, "theirs", FIRST)
    # Put the other model's state where this model's state for "mine" lives.
    shutil.copy(_state_file("theirs"), _state_file("mine"))
    ask(tiny_model, "ref", FIRST)
    reference = ask(tiny_model, "ref", SECOND, "--fresh")
    result = ask(tiny_model, "mine", SECOND)
    assert result["reply"] == reference["reply"]
    assert any("another model" in n for n in result["notices"])


def test_other_context_size_re_evaluates(tiny_model: Path) -> None:
    ask(tiny_model, "ctx", FIRST)
    result = ask(tiny_model, "ctx", SECOND, "--ctx", "2048")
    assert result["stats"]["restored_from_state"] is False
    assert any("context 4096, now 2048" in n for n in result["notices"])


def test_switching_models_keeps_each_models_state(
    tiny_model: Path, tiny_model_other_seed: Path
) -> None:
    ask(tiny_model, "both", FIRST)
    ask(tiny_model_other_seed, "both", SECOND)
    back = ask(tiny_model, "both", "third message")
    assert back["stats"]["restored_from_state"] is True
    assert len(list(app_paths().states_dir.glob("*.lckv"))) == 2


def test_a_conversation_in_use_is_refused_with_a_clear_message(tiny_model: Path) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=4096))
    store = Store(app_paths().database)
    holder = Conversation.open(store, StateStore(app_paths().states_dir), "busy", engine)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "localchat.cli.main",
                "ask",
                "hi",
                "--model-path",
                str(tiny_model),
                "--conversation",
                "busy",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2
        assert f"in use by another localchat process (pid {os.getpid()})" in result.stderr
        with pytest.raises(ConversationInUse):
            Conversation.open(store, StateStore(app_paths().states_dir), "busy", engine)
    finally:
        holder.close()
    assert ask(tiny_model, "busy", FIRST)["reply"]


def _limit_file_size() -> None:
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))


def test_full_disk_skips_the_state_but_keeps_the_transcript(small_model: Path) -> None:
    """A real write failure (the OS refuses bytes past RLIMIT_FSIZE, as on a full disk)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "localchat.cli.main",
            "ask",
            FIRST,
            "--model-path",
            str(small_model),
            "--conversation",
            "full",
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert any("KV state not saved" in n for n in payload["notices"])
    store = Store(app_paths().database)
    messages = store.messages(store.get("full").id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].content == payload["reply"]
    assert not list(app_paths().states_dir.glob("*.lckv"))


def test_a_q8_0_cache_halves_state_files_and_resumes_identically(small_model: Path) -> None:
    settings = app_paths().settings_file
    ask(small_model, "f16", FIRST)
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('kv_type = "q8_0"\n')
    ask(small_model, "q8", FIRST)
    ratio = _state_file("q8").stat().st_size / _state_file("f16").stat().st_size
    assert 0.5 < ratio < 0.56, "q8_0 stores 34 bytes per 32 values instead of 64"
    resumed = ask(small_model, "q8", SECOND)
    assert resumed["stats"]["restored_from_state"] is True
    assert resumed["reply"] == _warm_reply(small_model, "q8_0")
    fresh = ask(small_model, "q8", "third", "--fresh")
    assert fresh["stats"]["restored_from_state"] is False
    settings.write_text('kv_type = "q5"\n')
    result = subprocess.run(
        [sys.executable, "-m", "localchat.cli.main", "ask", "x", "--model-path", str(small_model)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "kv_type must be one of f16, q8_0, q4_0" in result.stderr
