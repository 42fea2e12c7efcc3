"""Shared prefix states: a long system prompt read once is restored for the next new
conversation (or one-off ask), and the greedy reply is the one a cold start gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.conversation.prefix_states import ID_PREFIX
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

PERSONA = " ".join(
    f"Rule {i}: answer in plain words, cite the guide, keep it short." for i in range(18)
)
QUESTION = "How do I reverse a list?"


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    loaded = Engine(tiny_model, LoadOptions(n_ctx=1024))
    yield loaded
    loaded.close()


def _turn(
    engine: Engine, states: StateStore, name: str, system: str = PERSONA, min_tokens: int = 256
) -> tuple[str, dict]:
    store = Store(app_paths().database)
    conversation = Conversation.open(
        store, states, name, engine, system, prefix_min_tokens=min_tokens
    )
    turn = conversation.send(QUESTION, GREEDY, 24)
    for _ in turn:
        pass
    conversation.saver.wait()
    conversation.close()
    store.close()
    engine.cache.reset()  # the next conversation starts from nothing in memory
    return turn.generation.text, turn.stats_dict()


def _prefix_files(states: StateStore) -> list[Path]:
    return [p for p in states.files() if p.name.startswith(ID_PREFIX)]


def test_a_known_system_prompt_is_restored_and_the_reply_is_the_same(engine: Engine) -> None:
    states = StateStore(app_paths().states_dir)
    cold_reply, cold = _turn(engine, states, "first")
    assert cold["restored_prefix_tokens"] == 0
    assert cold["prompt_tokens_evaluated"] == cold["prompt_tokens"] > 500  # all of it, read
    warm_reply, warm = _turn(engine, states, "second")
    assert warm["restored_prefix_tokens"] > 500  # the system prompt came from disk
    assert warm["prompt_tokens_evaluated"] == warm["prompt_tokens"] - warm["restored_prefix_tokens"]
    assert warm_reply == cold_reply  # token-identical to the cold start
    assert len(_prefix_files(states)) == 1  # one file for one prefix, however many use it
    _other, other = _turn(engine, states, "third", system=PERSONA + " One more rule.")
    assert other["restored_prefix_tokens"] == 0 and len(_prefix_files(states)) == 2


def test_short_prompts_and_the_setting_off_save_nothing(engine: Engine) -> None:
    states = StateStore(app_paths().states_dir)
    _turn(engine, states, "short", system="Be brief.")
    _turn(engine, states, "off", min_tokens=0)
    _reply, again = _turn(engine, states, "off-again", min_tokens=0)
    assert again["restored_prefix_tokens"] == 0
    assert _prefix_files(states) == []


def test_a_damaged_prefix_state_is_read_again_not_trusted(engine: Engine) -> None:
    states = StateStore(app_paths().states_dir)
    cold_reply, _ = _turn(engine, states, "first")
    (path,) = _prefix_files(states)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the KV payload: the checksum refuses it
    path.write_bytes(bytes(data))
    reply, stats = _turn(engine, states, "second")
    assert stats["restored_prefix_tokens"] == 0 and reply == cold_reply
    assert _prefix_files(states)  # saved again, whole


def test_prefix_states_share_the_disk_budget_least_recently_used_first(engine: Engine) -> None:
    probe = StateStore(app_paths().states_dir)
    _turn(engine, probe, "probe")
    one_prefix = _prefix_files(probe)[0].stat().st_size
    conversation_state = max(
        p.stat().st_size for p in probe.files() if p not in _prefix_files(probe)
    )
    for path in probe.files():
        path.unlink()
    # Room for the newest conversation's state and about two prefixes.
    states = StateStore(app_paths().states_dir, conversation_state + int(2.5 * one_prefix))
    replies = {}
    for index in range(3):
        replies[index], _ = _turn(
            engine, states, f"c{index}", system=PERSONA + f" Variant {index}."
        )
    assert len(_prefix_files(states)) <= 2
    assert states.total_bytes() <= states.budget_bytes
    reply, stats = _turn(engine, states, "again2", system=PERSONA + " Variant 2.")
    assert stats["restored_prefix_tokens"] > 0 and reply == replies[2]  # the newest stayed
    reply, stats = _turn(engine, states, "again", system=PERSONA + " Variant 0.")
    assert stats["restored_prefix_tokens"] == 0  # the oldest went first: read again
    assert reply == replies[0]


def test_a_one_off_ask_starts_from_the_saved_prefix(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["ask", QUESTION, "--model-path", str(tiny_model), "--ctx", "1024"]
    args += ["--system", PERSONA, "--temperature", "0", "--max-tokens", "16", "--json"]
    assert main(args) == 0
    cold = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    warm = json.loads(capsys.readouterr().out)
    assert cold["stats"]["restored_prefix_tokens"] == 0
    assert warm["stats"]["restored_prefix_tokens"] > 500
    assert warm["reply"] == cold["reply"]
    assert warm["stats"]["prompt_tokens_evaluated"] < 40
