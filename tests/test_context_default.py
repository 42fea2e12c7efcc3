"""The default context fits the model: the smaller of 4,096 and its trained context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.message import Message

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.cli.main import main
from localchat.tui.app import LocalChatApp
from tests.conftest import GREEDY

from .gguf_edit import rewrite_metadata
from .tui_helpers import ready


@pytest.fixture(scope="module")
def short_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model, marked as trained on 2,048 tokens."""
    dest = tmp_path_factory.mktemp("short") / "trained-2k.gguf"
    return rewrite_metadata(tiny_model, dest, {"llama.context_length": 2048})


def test_the_engine_defaults_to_the_trained_context(short_model: Path, tiny_model: Path) -> None:
    assert Engine(short_model, LoadOptions()).n_ctx == 2048
    assert Engine(tiny_model, LoadOptions()).n_ctx == 4096
    assert Engine(short_model, LoadOptions(n_ctx=1024)).n_ctx == 1024


def test_ask_opens_a_2k_model_without_ctx(short_model: Path, capsys) -> None:
    args = ["ask", "hi", "--model-path", str(short_model), "--max-tokens", "4", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["n_ctx"] == 2048


def test_an_explicit_ctx_above_the_trained_context_is_a_clear_error(
    short_model: Path, capsys
) -> None:
    assert main(["ask", "hi", "--model-path", str(short_model), "--ctx", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "larger than the model's trained context 2048; use --ctx 2048 or less" in err


async def test_the_app_opens_a_2k_model_without_ctx(short_model: Path) -> None:
    seen: list[Message] = []
    app = LocalChatApp(short_model, max_tokens=4, sampling=GREEDY)
    async with app.run_test(message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        assert app.backend is not None and app.backend.n_ctx == 2048
