"""The app's screens through App.run_test(): conversations, models (download, switch, add),
regenerate, system prompt, and the first-start paths."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.message import Message
from textual.widgets import DataTable, TextArea

from localchat.backends.base import Sampling
from localchat.paths import app_paths
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import (
    ModelLoaded,
    ModelMissing,
    ReplyFinished,
)
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.models import (
    DownloadFinished,
    DownloadProgress,
    ModelsScreen,
    RowsLoaded,
)
from localchat.tui.widgets.chat_message import AssistantMessage, UserMessage

from .hubserver import HubServer, HubState
from .tui_helpers import ready, say, wait_for

GREEDY = Sampling(temperature=0.0)


async def test_conversations_screen_resumes_another_conversation(tiny_model: Path) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        await say(pilot, seen, "first topic")
        first = app.conversation.record.name
        await pilot.press("ctrl+n")
        await pilot.pause(0.2)
        assert app.conversation.record.name != first
        await say(pilot, seen, "second topic")
        await pilot.press("ctrl+l")
        await pilot.pause(0.2)
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        await pilot.press(*"first")  # search narrows to the first conversation
        await pilot.pause(0.1)
        assert screen.query_one(DataTable).row_count == 1
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert app.conversation.record.name == first
        assert [u.text for u in app.query(UserMessage)] == ["first topic"]


async def test_regenerate_and_system_prompt(tiny_model: Path) -> None:
    seen: list[Message] = []
    app = LocalChatApp(
        tiny_model, n_ctx=1024, max_tokens=8, sampling=Sampling(temperature=1.0, seed=3)
    )
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        await say(pilot, seen, "tell me")
        mark = len(seen)
        await pilot.press("ctrl+r")
        await wait_for(pilot, seen, ReplyFinished, after=mark)
        await pilot.pause(0.1)
        store, conversation_id = app.conversation.store, app.conversation.record.id
        records = store.messages(conversation_id)
        assert [r.role for r in records] == ["user", "assistant"], "one answer in view"
        assert len(store.all_messages(conversation_id)) == 4  # the old one kept, as a branch
        assert len(app.query(AssistantMessage)) == 1
        await pilot.press("ctrl+s")
        await pilot.pause(0.2)
        app.screen.query_one(TextArea).text = "Answer in French."
        await pilot.press("ctrl+s")
        await pilot.pause(0.1)
        assert app.conversation.record.system_prompt == "Answer in French."
        assert not app.query(UserMessage)  # under the new system prompt: a new branch
        finished = await say(pilot, seen, "again")
        # The system prompt moved the head of the prompt: it was evaluated again.
        assert finished.stats.prompt_tokens_evaluated > 10
        assert app.conversation.branches_at(app.conversation.exchanges[0].record.id) == (
            3,
            3,
        )  # two answers to "tell me", and this


@pytest.fixture
def hub(tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubState]:
    repo = tmp_path / "hub" / "demo" / "small-GGUF"
    repo.mkdir(parents=True)
    shutil.copy(small_model, repo / "small-Q4_K_M.gguf")
    state = HubState({"demo/small-GGUF": repo})
    server = HubServer(state).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    catalog = app_paths().user_catalog
    catalog.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_text(
        """
[[model]]
name = "aaa-local-demo"
repo = "demo/small-GGUF"
architecture = "llama"
n_layer = 4
n_embd = 512
n_head = 8
n_head_kv = 4
head_dim = 64
n_vocab = 8192
context_length = 8192
[model.files]
Q4_K_M = { file = "small-Q4_K_M.gguf", size = SIZE }
""".replace("SIZE", str(small_model.stat().st_size))
    )
    yield state
    server.stop()


def _row_index(screen: ModelsScreen, model: str) -> int:
    return next(i for i, row in enumerate(screen.rows) if row.model == model)


async def test_models_screen_downloads_with_progress_and_switches(
    tiny_model: Path, hub: HubState
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        await say(pilot, seen, "hello on tiny")
        name = app.conversation.record.name
        mark = len(seen)
        await pilot.press("ctrl+o")
        await wait_for(pilot, seen, RowsLoaded, after=mark)
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        table = screen.query_one(DataTable)
        table.move_cursor(row=_row_index(screen, "aaa-local-demo"))
        await pilot.press("enter")
        finished = await wait_for(pilot, seen, DownloadFinished, after=mark)
        assert finished.error is None and finished.path is not None
        progress = [m.progress for m in seen[mark:] if isinstance(m, DownloadProgress)]
        assert progress[0].state == "downloading" and progress[-1].state == "done"
        assert progress[-1].bytes_done == progress[-1].bytes_total > 0
        loaded = await wait_for(pilot, seen, ModelLoaded, after=mark)
        assert loaded.backend.model_path == finished.path
        await pilot.pause(0.3)
        # Same conversation, now on the new model; the tiny model's state file is kept.
        assert app.conversation.record.name == name
        finished_turn = await say(pilot, seen, "hello on small")
        assert finished_turn.turn.conversation.engine.model_path == finished.path
        assert app.conversation.wait_saved() is None  # the new model's state is written
        states = list(app_paths().states_dir.glob(f"{app.conversation.record.id}.*.lckv"))
        assert len(states) == 2


async def test_demo_flag_opens_without_any_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    seen: list[Message] = []
    app = LocalChatApp(demo=True, n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        assert not [m for m in seen if isinstance(m, ModelMissing)]


async def test_models_screen_never_loads_a_projector_and_says_why(tiny_model: Path) -> None:
    snapshot = app_paths().hub_cache / "models--acme--vision-GGUF" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_model, snapshot / "mmproj-vision-F16.gguf")
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        mark = len(seen)
        await pilot.press("ctrl+o")
        await wait_for(pilot, seen, RowsLoaded, after=mark)
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        screen.query_one(DataTable).move_cursor(row=_row_index(screen, "acme/vision-GGUF"))
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert app.screen is screen, "the projector was not taken as a chat model"
        assert app.backend is not None and app.backend.model_path == tiny_model
        assert any("vision projector" in n.message for n in app._notifications)
