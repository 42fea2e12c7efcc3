"""Images in the app: attached with Ctrl+T (or pasted as a file's path), checked when
attached, stored when sent, shown in the transcript by name, size and pixels, and shown
again when the conversation is reopened. A model that reads no images refuses the message
before anything is stored, and the user's words and image wait in the composer.

The vision model is the generated LM with a generated projector beside it (as in
tests/test_vision_chat.py); the tests that run it are skipped where llama-cpp-python was
built without libmtmd."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual import events
from textual.widgets import TextArea

from localchat.backends.llama.vision import mtmd_unavailable
from localchat.paths import app_paths
from localchat.state.images import ImageStore
from localchat.tui.messages import ReplyFailed
from localchat.tui.widgets.chat_message import UserMessage
from localchat.tui.widgets.image_view import ImageView
from localchat.tui.widgets.prompt_input import pasted_path
from tests.image_helpers import random_png, vision_model_with
from tests.tui_helpers import ChatUI, chat_app

needs_mtmd = pytest.mark.skipif(
    mtmd_unavailable() is not None, reason=mtmd_unavailable() or "libmtmd loads"
)
SIZE = (100, 40)


@pytest.fixture(scope="module")
def vision_model(models_dir: Path) -> Path:
    return vision_model_with(models_dir)


def _png(path: Path, seed: int = 1, size: tuple[int, int] = (48, 36)) -> Path:
    path.write_bytes(random_png(seed, size))
    return path


def _stored_keys() -> list[str]:
    return ImageStore(app_paths().images_dir).keys()


async def _attach(ui: ChatUI, path: Path | str) -> None:
    from localchat.tui.screens.text_prompt import TextPromptScreen

    await ui.pilot.press("ctrl+t")
    prompt = await ui.shown(TextPromptScreen)
    prompt.query_one("#prompt-text", TextArea).text = str(path)
    await ui.pilot.press("ctrl+s")


def _image_lines(ui: ChatUI) -> list[str]:
    """The image lines of the questions drawn."""
    return [
        str(view.query_one(".image-line").render())
        for message in ui.app.chat.query(UserMessage)
        for view in message.query(ImageView)
    ]


@needs_mtmd
async def test_an_image_is_attached_sent_shown_and_shown_again_on_reopening(
    vision_model: Path, tmp_path: Path
) -> None:
    picture = _png(tmp_path / "garden.png")
    async with chat_app(
        vision_model, size=SIZE, n_ctx=1024, max_tokens=8, conversation_name="look"
    ) as ui:
        composer = ui.app.chat.composer
        await _attach(ui, picture)
        await ui.notice("Attached garden.png", "48×36 px")
        assert _stored_keys() == []  # checked, not stored until it is sent
        finished = await ui.say("what is in it")
        assert finished.turn.reply_id is not None
        [key] = _stored_keys()
        conversation = ui.app.conversation
        assert conversation is not None
        assert conversation.exchanges[-2].record.images == (key,)
        assert composer.images == [] and composer.box.text == ""
        [line] = _image_lines(ui)
        assert line.startswith("▣ garden.png · ") and line.endswith(" · 48×36 px")
        # A path pasted alone (a file dragged onto the terminal: quoted) is attached too.
        composer.box.post_message(events.Paste(f"'{picture}'"))
        await ui.until(lambda: len(composer.images) == 1, "the pasted image to be attached")
        assert composer.box.text == ""
        await ui.pilot.press("escape")  # and Esc takes it off again
        await ui.notice("Removed the attached garden.png")
        assert composer.images == []
    # Reopened: the image's line from the store (its key, its size and pixels).
    async with chat_app(
        vision_model, size=SIZE, n_ctx=1024, max_tokens=8, conversation_name="look"
    ) as ui:
        [line] = _image_lines(ui)
        assert line.startswith(f"▣ {key[:12]} · ") and line.endswith(" · 48×36 px")
        # Edited, the question shows its image again: the new branch's question has it.
        composer = ui.app.chat.composer
        ui.app.query(UserMessage).first().focus()
        await ui.pilot.press("e")
        await ui.until(lambda: len(composer.images) == 1, "the edited question's image")
        assert composer.box.text == "what is in it"
        await ui.say(" now")
        conversation = ui.app.conversation
        assert conversation is not None
        assert [e.record.images for e in conversation.exchanges] == [(key,), ()]
        assert conversation.exchanges[0].record.content == "what is in it now"


async def test_a_broken_image_is_refused_on_attaching_and_the_text_kept(
    tiny_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    async with chat_app(tiny_model, size=SIZE, n_ctx=512, max_tokens=8) as ui:
        composer = ui.app.chat.composer
        await ui.pilot.press(*"keep these words")
        await _attach(ui, broken)
        text = await ui.notice("broken.png")
        assert "\n" not in text
        assert composer.images == [] and composer.box.text == "keep these words"
        assert _stored_keys() == []


@needs_mtmd
async def test_a_model_without_a_projector_refuses_the_image_and_keeps_the_message(
    vision_model: Path, tmp_path: Path
) -> None:
    picture = _png(tmp_path / "garden.png")
    async with chat_app(vision_model, size=SIZE, n_ctx=1024, max_tokens=8, projector="none") as ui:
        chat = ui.app.chat
        await _attach(ui, picture)
        await ui.notice("Attached garden.png")
        mark = len(ui.seen)
        await ui.pilot.press(*"what is in it", "enter")
        failed = await ui.wait_for(ReplyFailed, after=mark)
        assert "cannot read images" in failed.error
        await ui.notice("cannot read images")
        await ui.until(lambda: not chat.generating, "the turn to be given up")
        # Nothing the user wrote is lost, nothing is stored.
        assert chat.composer.box.text == "what is in it"
        assert [i.line.name for i in chat.composer.images] == ["garden.png"]
        assert _stored_keys() == []
        conversation = ui.app.conversation
        assert conversation is not None and conversation.exchanges == []
        assert _image_lines(ui) == []


def test_a_pasted_path_is_read_as_terminals_paste_a_dragged_file(tmp_path: Path) -> None:
    spaced = tmp_path / "my picture.png"
    spaced.write_bytes(b"x")
    assert pasted_path(f"'{spaced}'") == spaced
    assert pasted_path(f'"{spaced}"\n') == spaced
    assert pasted_path(str(spaced).replace(" ", "\\ ")) == spaced
    assert pasted_path(f"file://{str(spaced).replace(' ', '%20')}") == spaced
    assert pasted_path(f"{spaced}\n{spaced}") is None  # two lines: text
    assert pasted_path(str(tmp_path)) is None  # a folder
    assert pasted_path("hello there") is None
