"""The vision bench's machinery (not its numbers), on the tiny model with the tiny projector:
a conversation with an image resumed in a new process, the figures all there. Skipped where
llama-cpp-python was built without libmtmd."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.backends.llama.vision import mtmd_unavailable
from localchat.bench.run import TARGETS
from localchat.bench.vision import VisionSetup, measure_vision

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
