"""The app's screens through App.run_test(): conversations, models (download, switch, add),
regenerate, system prompt, and the first-start paths."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import DataTable, TextArea

from localchat.backends.base import Sampling
from localchat.paths import app_paths
from localchat.tui.messages import ModelLoaded, ModelMissing
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.models import (
    DownloadFinished,
    DownloadProgress,
    ModelsScreen,
    RowsLoaded,
)
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.widgets.chat_message import AssistantMessage, UserMessage

from .hubserver import HubServer, HubState
from .tui_helpers import chat_app

SIZE = (120, 36)


async def test_conversations_screen_resumes_another_conversation(tiny_model: Path) -> None:
    async with chat_app(tiny_model, size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        app, pilot = ui.app, ui.pilot
        await ui.say("first topic")
        on_first = app.conversation
        first = on_first.record.name
        await pilot.press("ctrl+n")
        await ui.opened(before=on_first)
        assert app.conversation.record.name != first
        await ui.say("second topic")
        await pilot.press("ctrl+l")
        screen = await ui.shown(ConversationsScreen)
        table = screen.query_one(DataTable)
        await pilot.press(*"first")  # search narrows to the first conversation
        await ui.until(lambda: table.row_count == 1, "the search to narrow the list to one")
        on_second = app.conversation
        await pilot.press("enter")
        await ui.opened(before=on_second)
        assert app.conversation.record.name == first
        assert [u.text for u in app.query(UserMessage)] == ["first topic"]


async def test_regenerate_and_system_prompt(tiny_model: Path) -> None:
    sampling = Sampling(temperature=1.0, seed=3)
    async with chat_app(tiny_model, size=SIZE, n_ctx=1024, max_tokens=8, sampling=sampling) as ui:
        app, pilot = ui.app, ui.pilot
        await ui.say("tell me")
        await ui.send("ctrl+r")
        store, conversation_id = app.conversation.store, app.conversation.record.id
        records = store.messages(conversation_id)
        assert [r.role for r in records] == ["user", "assistant"], "one answer in view"
        assert len(store.all_messages(conversation_id)) == 4  # the old one kept, as a branch
        assert len(app.query(AssistantMessage)) == 1
        await pilot.press("ctrl+s")
        editor = await ui.shown(TextPromptScreen)
        editor.query_one(TextArea).text = "Answer in French."
        await pilot.press("ctrl+s")
        await ui.notice("System prompt saved")  # the save's last step
        assert app.conversation.record.system_prompt == "Answer in French."
        assert not app.query(UserMessage)  # under the new system prompt: a new branch
        finished = await ui.say("again")
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
    async with chat_app(tiny_model, size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        await ui.say("hello on tiny")
        on_tiny = app.conversation
        name = on_tiny.record.name
        mark = len(ui.seen)
        await ui.pilot.press("ctrl+o")
        await ui.wait_for(RowsLoaded, after=mark)
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        table = screen.query_one(DataTable)
        table.move_cursor(row=_row_index(screen, "aaa-local-demo"))
        await ui.pilot.press("enter")
        finished = await ui.wait_for(DownloadFinished, after=mark)
        assert finished.error is None and finished.path is not None
        progress = [m.progress for m in ui.posted(DownloadProgress)]
        assert progress[0].state == "downloading" and progress[-1].state == "done"
        assert progress[-1].bytes_done == progress[-1].bytes_total > 0
        loaded = await ui.wait_for(ModelLoaded, after=mark)
        assert loaded.backend.model_path == finished.path
        await ui.opened(before=on_tiny)
        # Same conversation, now on the new model; the tiny model's state file is kept.
        assert app.conversation.record.name == name
        finished_turn = await ui.say("hello on small")
        assert finished_turn.turn.conversation_id == app.conversation.record.id
        assert app.conversation.backend.model_path == finished.path
        assert app.conversation.wait_saved() is None  # the new model's state is written
        states = list(app_paths().states_dir.glob(f"{app.conversation.record.id}.*.lckv"))
        assert len(states) == 2


async def test_demo_flag_opens_without_any_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    async with chat_app(demo=True, size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        assert not ui.posted(ModelMissing)


async def test_models_screen_never_loads_a_projector_and_says_why(tiny_model: Path) -> None:
    snapshot = app_paths().hub_cache / "models--acme--vision-GGUF" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_model, snapshot / "mmproj-vision-F16.gguf")
    async with chat_app(tiny_model, size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        mark = len(ui.seen)
        await ui.pilot.press("ctrl+o")
        await ui.wait_for(RowsLoaded, after=mark)
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        screen.query_one(DataTable).move_cursor(row=_row_index(screen, "acme/vision-GGUF"))
        await ui.pilot.press("enter")
        await ui.notice("vision projector")  # said at once, in place of loading it
        assert app.screen is screen, "the projector was not taken as a chat model"
        assert app.backend is not None and app.backend.model_path == tiny_model
