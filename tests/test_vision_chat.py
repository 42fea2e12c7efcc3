"""Conversations with images, on the generated LM with a generated projector beside it:
each image encoded once, its positions saved with the conversation's state, and a resumed,
branched or edited conversation continuing exactly as a fresh evaluation would. Skipped
where llama-cpp-python was built without libmtmd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine
from localchat.backends.llama.image_positions import image_starts
from localchat.backends.llama.vision import mtmd_unavailable
from localchat.chat.image_files import inspect_image
from localchat.conversation.local import Conversation
from localchat.errors import UsageError
from localchat.models.launch import LaunchOptions
from localchat.models.loader import ModelLoader
from localchat.paths import app_paths
from localchat.state.images import ImageStore
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY
from tests.image_helpers import random_png, vision_model_with

pytestmark = pytest.mark.skipif(
    mtmd_unavailable() is not None, reason=mtmd_unavailable() or "libmtmd loads"
)

LOOK, FOLLOW, MORE = "What is in this picture?", "And what colour is it?", "Tell me more."


@pytest.fixture(scope="module")
def vision_model(models_dir: Path) -> Path:
    return vision_model_with(models_dir)


def _stored(seed: int) -> str:
    """A random picture put in this home's image store; its key."""
    return ImageStore(app_paths().images_dir).put(inspect_image(random_png(seed), "p.png")).key


def _load(model: Path, **launch: object) -> Engine:
    return ModelLoader(app_paths()).load(
        model,
        LaunchOptions(**{"n_ctx": 1024, **launch}),  # type: ignore[arg-type]
        on_this_thread=True,  # type: ignore[arg-type]
    )


@pytest.fixture
def engines(vision_model: Path) -> Iterator[list[Engine]]:
    """Engines loaded by a test (each a process's worth of state), closed after it."""
    loaded: list[Engine] = []
    yield loaded
    for engine in loaded:
        engine.close()


def _open(engines: list[Engine], model: Path, name: str) -> tuple[Conversation, Engine]:
    engine = _load(model)
    engines.append(engine)
    states = StateStore(app_paths().states_dir)
    return Conversation.open(Store(app_paths().database), states, name, engine), engine


def _say(conversation: Conversation, text: str, images: tuple[str, ...] = (), fresh=False):  # type: ignore[no-untyped-def]
    turn = conversation.send(text, GREEDY, 16, fresh=fresh, images=images)
    for _ in turn:
        pass
    return turn


def _after_last_image(tokens: list[int]) -> int:
    """How many positions follow the prompt's last image (which it must hold)."""
    last = max(i for i, t in enumerate(tokens) if t < 0)
    return len(tokens) - last - 1


@pytest.mark.parametrize(
    ("shape", "chunks"), [("vit-tiny", 1), ("idefics3-tiny", 5), ("qwen2vl-tiny", 1)]
)
def test_a_resumed_conversation_with_an_image_is_exact_and_encodes_nothing(
    models_dir: Path, engines: list[Engine], shape: str, chunks: int
) -> None:
    """Also for a projector that reads an image as an overview and slices (Idefics3's:
    SmolVLM's), each slice encoded once and kept as an image of its own, and for one that
    places it with M-RoPE (Qwen2-VL's: fewer positions than cells, the text after it
    positioned after its longer side), its positions kept in the state."""
    vision_model = vision_model_with(models_dir, shape)
    picture = _stored(1)
    warm, warm_engine = _open(engines, vision_model, "warm")
    _say(warm, LOOK, (picture,))
    _say(warm, FOLLOW)
    last = _say(warm, MORE)
    expected = last.generation.text
    assert warm_engine.image_reader is not None and warm_engine.image_reader.encodes == chunks
    assert len(image_starts(last.prompt.tokens)) == chunks  # a run each
    warm.close()

    first, _ = _open(engines, vision_model, "resumed")
    _say(first, LOOK, (picture,))
    _say(first, FOLLOW)
    first.close()

    resumed, engine = _open(engines, vision_model, "resumed")
    turn = _say(resumed, MORE)
    stats = turn.stats_dict()
    assert turn.generation.text == expected
    assert turn.restore.restored
    assert engine.image_reader is not None and engine.image_reader.encodes == 0
    # Only what follows the reply before it was read: nothing of the image or before it.
    assert stats["prompt_tokens_evaluated"] <= _after_last_image(turn.prompt.tokens) - 8
    resumed.close()

    # Rebuilt from the transcript (its original batches, the image decoded from the
    # embeddings kept on disk): the same reply, still no encode.
    fresh, fresh_engine = _open(engines, vision_model, "resumed")
    assert fresh.take_back_last_exchange() == MORE  # the reply is asked for again
    again = _say(fresh, MORE, fresh=True)
    assert again.generation.text == expected
    assert again.restore.replayed > 0
    assert fresh_engine.image_reader is not None and fresh_engine.image_reader.encodes == 0
    fresh.close()


def test_a_non_causal_image_resumes_exactly(models_dir: Path, engines: list[Engine]) -> None:
    """Gemma 3's projector: the image decoded with non-causal attention, between begin- and
    end-of-image text libmtmd writes around it."""
    model = vision_model_with(models_dir, "gemma3-tiny")
    picture = _stored(7)
    warm, engine = _open(engines, model, "warm")
    assert engine.image_reader is not None and engine.image_reader.projector.non_causal
    _say(warm, LOOK, (picture,))
    expected = _say(warm, FOLLOW).generation.text
    warm.close()
    first, _ = _open(engines, model, "resumed")
    _say(first, LOOK, (picture,))
    first.close()
    resumed, engine = _open(engines, model, "resumed")
    turn = _say(resumed, FOLLOW)
    assert turn.generation.text == expected and turn.restore.restored
    assert engine.image_reader is not None and engine.image_reader.encodes == 0
    resumed.close()


def test_a_first_message_of_a_file_and_images_past_a_batch_starts_from_a_shared_prefix(
    models_dir: Path, engines: list[Engine]
) -> None:
    """The file and images a first message opens with are a shared prefix, evaluated in
    batches that never end inside an image (nine 64-cell images cross the 512-token batch),
    saved, and restored by the next conversation that opens with them."""
    from localchat.chat.attachments import Attachment, with_attachments

    model = vision_model_with(models_dir, "vit-small")
    text = with_attachments(LOOK, [Attachment("notes.txt", "some file text here\n" * 12)])
    pictures = tuple(_stored(seed) for seed in range(20, 29))
    first, _ = _open(engines, model, "first")
    expected = _say(first, text, pictures).generation.text
    first.close()
    second, engine = _open(engines, model, "second")
    turn = _say(second, text, pictures)
    assert turn.generation.text == expected
    assert turn.restore.prefix_tokens > 9 * 64  # the images and the file, from disk
    assert engine.image_reader is not None and engine.image_reader.encodes == 0
    second.close()


def test_another_image_gives_another_reply_and_the_same_image_encodes_once(
    vision_model: Path, engines: list[Engine]
) -> None:
    one, other = _stored(1), _stored(2)
    a, engine = _open(engines, vision_model, "a")
    reply_a = _say(a, LOOK, (one,)).generation.text
    b, _ = _open(engines, vision_model, "b")
    reply_b = _say(b, LOOK, (other,)).generation.text
    assert reply_a != reply_b  # no state of the first image served the second
    a.close()
    b.close()

    c, engine = _open(engines, vision_model, "c")  # a new process: the embeddings on disk
    assert _say(c, LOOK, (one,)).generation.text == reply_a
    assert engine.image_reader is not None and engine.image_reader.encodes == 0
    c.close()


@pytest.mark.parametrize("shape", ["vit-tiny", "qwen2vl-tiny"])
def test_an_edit_after_an_image_restores_it_from_disk(
    models_dir: Path, engines: list[Engine], shape: str
) -> None:
    """Also where the image's positions are M-RoPE's (the cut after it is at a position
    short of its index)."""
    vision_model = vision_model_with(models_dir, shape)
    picture = _stored(3)
    reference, _ = _open(engines, vision_model, "reference")
    _say(reference, LOOK, (picture,))
    expected = _say(reference, "Something else entirely?").generation.text
    reference.close()

    chat, _ = _open(engines, vision_model, "edited")
    _say(chat, LOOK, (picture,))
    second = _say(chat, FOLLOW)
    chat.close()

    chat, engine = _open(engines, vision_model, "edited")
    chat.branch_before(second.user.record.id)
    edited = _say(chat, "Something else entirely?")
    assert edited.generation.text == expected
    assert edited.restore.restored
    assert engine.image_reader is not None and engine.image_reader.encodes == 0
    assert edited.stats_dict()["prompt_tokens_evaluated"] <= _after_last_image(edited.prompt.tokens)
    chat.close()


def test_a_reply_asked_again_after_an_m_rope_image_cuts_the_cache_at_its_position(
    models_dir: Path, engines: list[Engine]
) -> None:
    """The warm cache cut back to the question as the evaluation cuts it (the old reply's
    cells dropped from their position, which M-RoPE puts short of their index): the same
    reply, one token read."""
    chat, engine = _open(engines, vision_model_with(models_dir, "qwen2vl-tiny"), "again")
    _say(chat, LOOK, (_stored(9),))
    first = _say(chat, FOLLOW).generation.text
    assert chat.take_back_last_exchange() == FOLLOW
    again = _say(chat, FOLLOW)
    assert again.generation.text == first
    assert again.stats_dict()["prompt_tokens_evaluated"] == 1
    assert engine.image_reader is not None and engine.image_reader.encodes == 1
    chat.close()


def test_a_model_without_a_projector_refuses_images_and_stores_nothing(
    vision_model: Path,
) -> None:
    engine = _load(vision_model, projector="none")
    try:
        store = Store(app_paths().database)
        chat = Conversation.open(store, StateStore(app_paths().states_dir), "blind", engine)
        with pytest.raises(UsageError, match="cannot read images"):
            chat.send(LOOK, GREEDY, 8, images=(_stored(4),))
        assert chat.exchanges == []
        assert store.messages(chat.record.id) == []
        chat.close()
    finally:
        engine.close()


def test_a_message_longer_than_the_context_keeps_its_images_and_loses_text_only(
    vision_model: Path,
) -> None:
    """Cut from its text, never from its images; where the images alone cannot fit, the
    message is refused saying so (never sent without them)."""
    engine = _load(vision_model, n_ctx=128)
    try:
        store = Store(app_paths().database)
        chat = Conversation.open(store, StateStore(app_paths().states_dir), "long", engine)
        words = " ".join(f"word{i}" for i in range(200))
        turn = _say(chat, words, (_stored(5),))
        stats = turn.stats_dict()
        assert stats["window_cut_tokens"] > 0
        assert len(image_starts(turn.prompt.tokens)) == 1  # the image is still in the prompt
        assert len(turn.prompt.tokens) <= 128
        many = tuple(_stored(seed) for seed in range(10, 18))  # 8 x 16 cells and some text
        with pytest.raises(UsageError, match=r"image\(s\) take more of the context"):
            _say(chat, words, many)
        # Refused before it was stored: the box keeps it in the app, as for any refusal.
        assert [len(m.images) for m in store.messages(chat.record.id)] == [1, 0]
        chat.close()
    finally:
        engine.close()


def _ask(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localchat.cli.main", "ask", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def test_ask_shows_the_model_an_image_and_refuses_what_it_cannot_read(
    vision_model: Path, tmp_path: Path
) -> None:
    picture = tmp_path / "photo.png"
    picture.write_bytes(random_png(5))
    flags = ("--model-path", str(vision_model), "--temperature", "0", "--max-tokens", "8")
    shown = _ask(LOOK, "--image", str(picture), *flags, "--json")
    assert shown.returncode == 0, shown.stderr
    payload = json.loads(shown.stdout)
    assert payload["stats"]["prompt_tokens"] > 16  # the image's cells are in the prompt
    # --attach takes an image by its type, the same as --image.
    attached = _ask(LOOK, "--attach", str(picture), *flags, "--json")
    assert json.loads(attached.stdout)["reply"] == payload["reply"]

    blind = _ask(LOOK, "--image", str(picture), *flags, "--mmproj", "none")
    assert blind.returncode == 2
    assert "cannot read images" in blind.stderr and len(blind.stderr.strip().splitlines()) == 1

    broken = tmp_path / "broken.png"
    broken.write_bytes(random_png(6)[:200])
    refused = _ask(LOOK, "--image", str(broken), *flags)
    assert refused.returncode == 2
    assert "broken.png" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert not any(app_paths().images_dir.glob("*/*")) or all(
        p.name != "broken" for p in app_paths().images_dir.rglob("*")
    )
