"""The vision bench's machinery (not its numbers), on the tiny model with the tiny projector:
a conversation with an image resumed in a new process, the figures all there. Skipped where
llama-cpp-python was built without libmtmd."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.backends.llama.vision import mtmd_unavailable
from localchat.bench.run import TARGETS
from localchat.bench.vision import VisionSetup, measure_vision, random_png

pytestmark = pytest.mark.skipif(
    mtmd_unavailable() is not None, reason=mtmd_unavailable() or "libmtmd loads"
)


def test_a_conversation_with_an_image_is_measured_warm_and_resumed(tiny_model: Path) -> None:
    setup = VisionSetup(tiny_model, "vit-tiny", rounds=1, encode_rounds=2, picture_size=(64, 48))
    figures = measure_vision(setup)
    assert figures["image_tokens"] == 16
    assert figures["image_first_turn_encoded"] == 1  # the first turn encoded the image
    assert figures["image_encodes_on_resume"] == 0  # the new process restored it
    assert figures["image_resume_restored"] and figures["image_replies_identical"]
    assert 0 < figures["image_turn_reread"] < 1
    assert figures["image_encode_s"] > 0 and figures["image_resume_vs_warm"] > 0
    targeted = {"image_resume_vs_warm", "image_encodes_on_resume", "image_turn_reread"}
    assert targeted <= set(TARGETS) and targeted <= set(figures)


def test_a_turns_stats_count_the_images_it_encoded_replaying_or_reading(
    tiny_model: Path, tmp_path: Path
) -> None:
    """``images_encoded``: 1 where the prompt's image was encoded, 0 where its embeddings were
    kept, and 1 again for a replay that found none kept (the figure covers the replay too)."""
    import shutil

    from localchat.chat.image_files import inspect_image
    from localchat.conversation.local import Conversation
    from localchat.models.demo_vision import make_projector
    from localchat.models.launch import LaunchOptions
    from localchat.models.loader import ModelLoader
    from localchat.paths import app_paths
    from localchat.state.images import ImageStore
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store
    from tests.conftest import GREEDY

    folder = tmp_path / "vision"
    folder.mkdir()
    model = folder / tiny_model.name
    model.symlink_to(tiny_model)
    make_projector(folder / "mmproj-vit-tiny-F16.gguf", "tiny", "vit-tiny")
    paths = app_paths()
    picture = inspect_image(random_png((48, 36), seed=7), "p.png")
    key = ImageStore(paths.images_dir).put(picture).key

    def turn_encodes(text: str, images: tuple[str, ...] = (), fresh: bool = False) -> int:
        engine = ModelLoader(paths).load(model, LaunchOptions(n_ctx=1024), on_this_thread=True)
        store = Store(paths.database)
        try:
            chat = Conversation.open(store, StateStore(paths.states_dir), "c", engine)
            turn = chat.send(text, GREEDY, 4, fresh=fresh, images=images)
            for _ in turn:
                pass
            chat.close()
            return int(turn.stats_dict()["images_encoded"])
        finally:
            store.close()
            engine.close()

    assert turn_encodes("Look.", (key,)) == 1
    assert turn_encodes("Again.", (key,)) == 0  # the embeddings kept on disk
    shutil.rmtree(paths.image_embeddings_dir)
    assert turn_encodes("Once more.", fresh=True) == 1  # the replay had to encode them
