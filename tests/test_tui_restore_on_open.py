"""Opening a conversation in the app restores its saved cache at once, in the background:
the first turn after opening is a warm turn (nothing of the history is read again)."""

from __future__ import annotations

from pathlib import Path

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.conversation.local import Conversation
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.messages import ConversationRestored
from tests.conftest import GREEDY
from tests.tui_helpers import chat_app


def _saved_conversation(model: Path, name: str) -> int:
    store = Store(app_paths().database)
    engine = Engine(model, LoadOptions(n_ctx=512))
    conversation = Conversation.open(store, StateStore(app_paths().states_dir), name, engine)
    for text in ("Tell me about caches.", "And about windows?"):
        for _ in conversation.send(text, GREEDY, 24):
            pass
    conversation.saver.wait()
    held = len(engine.cache.cached_tokens)
    conversation.close()
    store.close()
    engine.close()
    return held


async def test_an_opened_conversation_is_restored_before_the_first_turn(tiny_model: Path) -> None:
    held = _saved_conversation(tiny_model, "talk")
    async with chat_app(
        tiny_model, size=(120, 36), n_ctx=512, max_tokens=8, conversation_name="talk"
    ) as ui:
        restored = await ui.wait_for(ConversationRestored)
        assert restored.tokens == held
        finished = await ui.say("ok")
        assert not finished.turn.restore.restored  # nothing left to restore in the turn
        stats = finished.turn.stats_dict()
        assert stats["prompt_tokens"] - stats["prompt_tokens_evaluated"] >= held - 1
        assert stats["prompt_tokens_evaluated"] < 20  # only the new message was read
