"""Which projector goes with a model, and what it costs in the plan: generated files, no
libmtmd needed (``models/projectors.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from localchat.errors import UsageError
from localchat.models.demo_vision import make_projector
from localchat.models.hardware import Hardware
from localchat.models.planner import plan_file
from localchat.models.projectors import chosen_projector, find_projector, projector_memory_bytes

GIB = 1024**3


@pytest.fixture
def folder(tmp_path: Path, tiny_model: Path, small_model: Path) -> Path:
    """A folder as downloads leave it: two models and projectors for one of them."""
    shutil.copy(tiny_model, tmp_path / "tiny-Q4_K_M.gguf")
    shutil.copy(small_model, tmp_path / "small-Q4_K_M.gguf")
    make_projector(tmp_path / "mmproj-tiny-F16.gguf", "tiny", "vit-tiny")
    make_projector(tmp_path / "mmproj-tiny-Q4_K_M.gguf", "tiny", "vit-small")
    return tmp_path


def test_the_projector_beside_a_model_is_the_one_that_fits_it(folder: Path) -> None:
    # The model's own tag first; a projector for another width is never taken.
    assert find_projector(folder / "tiny-Q4_K_M.gguf") == folder / "mmproj-tiny-Q4_K_M.gguf"
    assert find_projector(folder / "small-Q4_K_M.gguf") is None
    (folder / "mmproj-tiny-Q4_K_M.gguf").unlink()
    assert find_projector(folder / "tiny-Q4_K_M.gguf") == folder / "mmproj-tiny-F16.gguf"


def test_a_projector_given_is_checked_against_the_model(folder: Path) -> None:
    tiny, small = folder / "tiny-Q4_K_M.gguf", folder / "small-Q4_K_M.gguf"
    projector = folder / "mmproj-tiny-F16.gguf"
    assert chosen_projector(tiny, str(projector)) == projector
    assert chosen_projector(tiny, "none") is None
    with pytest.raises(UsageError, match="another model's projector"):
        chosen_projector(small, str(projector))
    with pytest.raises(UsageError, match="not a vision projector"):
        chosen_projector(tiny, str(small))
    with pytest.raises(UsageError, match="no such file"):
        chosen_projector(tiny, str(folder / "missing.gguf"))


def test_the_plan_counts_the_projector(folder: Path) -> None:
    model, projector = folder / "tiny-Q4_K_M.gguf", folder / "mmproj-tiny-F16.gguf"
    extra = projector_memory_bytes(projector)
    assert extra > projector.stat().st_size  # the weights and an encode's compute buffer
    hardware = Hardware(4 * GIB, 4 * GIB, 4)
    alone = plan_file(model, hardware, 2048)
    seeing = plan_file(model, hardware, 2048, projector_bytes=extra)
    assert seeing.estimated_bytes == alone.estimated_bytes + extra
    assert "vision projector" in seeing.explanation
