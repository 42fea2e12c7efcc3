"""The app's first start: it checks where a model can come from before anything else, shows
each step (check, speed calibration, download) with a bar and the time left, Esc skips the
calibration, and without the hub it chats on the starter model from the package index."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.message import Message

from localchat.backends.base import Sampling
from localchat.models.starter import STARTER
from localchat.paths import app_paths
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ModelMissing, StartupNotice, StartupProgress, StartupStep
from localchat.tui.screens.no_model import NoModelScreen
from localchat.tui.screens.startup import StartupScreen

from .conftest import DEAD
from .hubserver import HubServer, HubState
from .indexserver import IndexState
from .tui_helpers import ready, wait_for

GREEDY = Sampling(temperature=0.0)


@pytest.fixture
def default_model_hub(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubState]:
    """The hub serving the first-start default model's repo (small-model bytes under every
    catalog file name, so whichever quant the planner picks here exists)."""
    from localchat.models.catalog import find_model, load_catalog
    from localchat.session import DEFAULT_MODEL

    entry = find_model(load_catalog(), DEFAULT_MODEL)
    repo = tmp_path / "hub" / entry.repo
    repo.mkdir(parents=True)
    for quant_file in entry.files:
        os.link(small_model, repo / quant_file.file)
    state = HubState({entry.repo: repo})
    server = HubServer(state).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    yield state
    server.stop()


async def test_first_start_downloads_the_default_model_with_a_progress_screen(
    default_model_hub: HubState, calibrated: object
) -> None:
    seen: list[Message] = []
    screens: list[str] = []
    plans: list[str] = []
    app = LocalChatApp(n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        for _ in range(400):
            screens.append(type(app.screen).__name__)
            if isinstance(app.screen, StartupScreen):
                plans += [str(w.render()) for w in app.screen.query("#startup-plan")]
            if app.conversation is not None:
                break
            await pilot.pause(0.02)
        await ready(pilot, app, seen)
        progress = [m.progress for m in seen if isinstance(m, StartupProgress)]
        assert progress and progress[-1].state == "done"
        assert "StartupScreen" in screens
        # Calibrated already: two steps, the check first.
        steps = [m.step for m in seen if isinstance(m, StartupStep)]
        assert steps[0].title == "checking where a model can come from"
        assert {(s.step, s.steps) for s in steps} <= {(1, 2), (2, 2)}
        # The screen says which quant the planner chose here and how fast it will run.
        notices = [m.text for m in seen if isinstance(m, StartupNotice)]
        assert any("tok/s here" in n for n in notices), notices
        assert any("tok/s here" in p for p in plans), plans
        assert type(app.screen).__name__ == "ChatScreen", (
            "the progress screen closes when the model loads"
        )
        assert app.backend is not None
        assert app.backend.model_path.is_relative_to(app_paths().hub_cache)


async def test_first_start_measures_the_machine_and_esc_skips_it(
    default_model_hub: HubState,
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        for _ in range(1200):  # until the calibration step shows (a minute at most)
            if any(isinstance(m, StartupStep) and m.step.skippable for m in seen):
                break
            await pilot.pause(0.05)
        await pilot.pause(0.1)
        assert isinstance(app.screen, StartupScreen)
        hint = str(app.screen.query_one("#startup-hint").render())
        assert "Esc skips this step" in hint
        assert "Step 2 of 3: Measuring this machine's speed" in str(
            app.screen.query_one("#startup-step").render()
        )
        await pilot.press("escape")
        await ready(pilot, app, seen)
        assert not app_paths().speed_calibration.exists()  # measured later, not now
        assert any("skipped" in n.message for n in app._notifications)
        assert app.backend is not None  # the download went on, planned by memory
        steps = [m.step for m in seen if isinstance(m, StartupStep)]
        assert steps[0].step == 1 and steps[-1].title.startswith("downloading")


async def test_first_start_without_the_hub_chats_on_the_starter_from_the_index(
    package_index: IndexState,
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        assert app.backend is not None and app.backend.model_path.name == STARTER.filename
        assert any("hub cannot be reached" in n.message for n in app._notifications)
        assert not app_paths().speed_calibration.exists()  # no time spent calibrating
        assert [m.progress for m in seen if isinstance(m, StartupProgress)][-1].state == "done"


async def test_first_start_without_any_network_offers_the_demo(
    monkeypatch: pytest.MonkeyPatch, calibrated: object
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    seen: list[Message] = []
    app = LocalChatApp(n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 36), message_hook=seen.append) as pilot:
        missing = await wait_for(pilot, seen, ModelMissing)
        assert isinstance(missing, ModelMissing)
        assert "127.0.0.1:9" in missing.reason and "package index" in missing.reason
        await pilot.pause(0.2)
        assert isinstance(app.screen, NoModelScreen)
        await pilot.click("#use-demo")
        await ready(pilot, app, seen)
        assert app.backend is not None and app.backend.model_path.name.startswith("demo-small")
        assert any("talks nonsense" in n.message for n in app._notifications)
