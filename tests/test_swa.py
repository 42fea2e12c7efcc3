"""Sliding-window models keep only their window in the cache, and stay exact.

The demo factory's ``swa-tiny`` shape is a gemma3-architecture model: five of every six
layers attend 64 positions back. With the window cache those layers keep only 768 cells
(window + micro-batch, padded), so a cache that held 1,000+ tokens cannot simply be cut
back: regenerate, edits and restored states must rebuild (replay) instead, and every reply
must equal the one a full-size cache gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.conversation import Conversation
from localchat.demo import make_demo_model
from localchat.engine import Engine, LoadOptions, Sampling
from localchat.kvstate import StateStore
from localchat.paths import app_paths
from localchat.store import Store

GREEDY = Sampling(temperature=0.0)
CTX = 4096
WORDS = "the window keeps what the layers look at and nothing more than that".split()


@pytest.fixture(scope="session")
def swa_model(models_dir: Path) -> Path:
    return make_demo_model(models_dir / "swa-tiny-Q8_0.gguf", "swa-tiny", "Q8_0")


def _engine(path: Path, swa_cache: str) -> Engine:
    return Engine(path, LoadOptions(n_ctx=CTX, swa_cache=swa_cache))


def _text(turn: int, words: int = 260) -> str:
    return " ".join(WORDS[(turn * 5 + i) % len(WORDS)] for i in range(words))


def test_the_window_cache_is_what_llama_cpp_allocated(swa_model: Path) -> None:
    window, full = _engine(swa_model, "window"), _engine(swa_model, "full")
    try:
        assert window.n_swa == 64 and window.windowed and not full.windowed
        cells = sorted(c.cells for c in window.buffers.kv)
        assert cells[0] < CTX and cells[1] >= CTX  # a window cache beside the full one
        assert all(c.cells >= CTX for c in full.buffers.kv)
        assert window.kv_bytes_allocated == window.buffers.kv_bytes
        assert window.kv_bytes_allocated < 0.5 * full.kv_bytes_allocated
        # The live figure never counts more cells than a window cache has.
        assert window.kv_bytes_for(3000) < full.kv_bytes_for(3000)
        assert window.kv_bytes_for(10) == full.kv_bytes_for(10)
        assert window.buffers.compute and window.buffers.weights
    finally:
        window.close()
        full.close()


def test_a_window_cache_cannot_be_cut_back_past_its_window(swa_model: Path) -> None:
    engine = _engine(swa_model, "window")
    try:
        prompt = engine.tokenize(_text(0, 1400), add_bos=True)[:1500]
        engine.hold(prompt)
        assert engine.cached_tokens == prompt
        assert engine.keeps(len(prompt) - 10)
        assert not engine.keeps(200), "those positions left the sliding-window cache"
        # hold() to a short prefix rebuilds (replays) instead of cutting.
        engine.hold(prompt[:200])
        assert engine.cached_tokens == prompt[:200] or engine.cached_tokens == []
    finally:
        engine.close()


def _conversation(path: Path, swa_cache: str, name: str) -> tuple[Conversation, Engine]:
    engine = _engine(path, swa_cache)
    data = app_paths().data_dir / swa_cache
    store = Store(data / "conversations.sqlite3")
    return Conversation.open(store, StateStore(data / "states"), name, engine), engine


def _reply(conversation: Conversation, text: str, evaluated: list[int] | None = None) -> str:
    turn = conversation.send(text, GREEDY, 24)
    for _ in turn:
        pass
    if evaluated is not None:
        evaluated.append(turn.stats.prompt_tokens_evaluated)
    return turn.generation.text


def test_turns_regenerate_and_resume_match_the_full_cache(swa_model: Path) -> None:
    replies: dict[str, list[str]] = {}
    edit_cost: dict[str, list[int]] = {"full": [], "window": []}
    for mode in ("full", "window"):
        conversation, engine = _conversation(swa_model, mode, "long")
        out = [_reply(conversation, _text(turn)) for turn in range(4)]  # past 768 cells
        assert len(engine.cached_tokens) > 1000
        # Regenerate: the last exchange goes, the same question is asked again.
        question = conversation.take_back_last_exchange()
        assert question is not None
        out.append(_reply(conversation, question))
        # An edit far back: three exchanges go, another question in their place. The window
        # cache no longer has what the layers must see there: it is rebuilt, not cut.
        for _ in range(3):
            conversation.take_back_last_exchange()
        out.append(_reply(conversation, "something else entirely, asked instead", edit_cost[mode]))
        out += [_reply(conversation, _text(turn)) for turn in (5, 6)]  # past the window again
        conversation.save_state()
        conversation.saver.wait(30)
        conversation.close()
        engine.close()
        # Resumed in a new engine from the saved state: only the new message is evaluated.
        conversation, engine = _conversation(swa_model, mode, "long")
        turn = conversation.send(_text(9, 30), GREEDY, 24)
        for _ in turn:
            pass
        out.append(turn.generation.text)
        assert turn.restore.restored, mode
        stats = turn.stats
        assert stats.prompt_tokens > 1000 and stats.prompt_tokens_evaluated < 120, mode
        conversation.close()
        engine.close()
        replies[mode] = out
    assert replies["window"] == replies["full"]
    # The full cache was cut; the window cache was rebuilt up to the edit (in its batches).
    assert edit_cost["window"][0] > edit_cost["full"][0] + 200
    assert replies["window"][4] == replies["window"][3], "regenerate gives the same reply"
