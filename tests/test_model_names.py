"""The name a model is shown and served under: its repository's or its file's, with its
quant, never general.name (a training run's label)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.gguf.info import read_gguf
from localchat.gguf.names import display_name, repo_of

HF = "/h/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF/snapshots/ab12"
STUDIO = "/home/u/.lmstudio/models/lmstudio-community/Meta-Llama-3-8B-Instruct-GGUF"


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        # The repository's spelling where the file is named after it; the file's quant.
        (f"{HF}/smollm2-135m-instruct-q4_1.gguf", "SmolLM2-135M-Instruct Q4_1"),
        (f"{STUDIO}/Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct Q4_K_M"),
        # A file named otherwise than its repository keeps its own name; a split set is one.
        ("/x/models--unsloth--Qwen3-8B-GGUF/snapshots/c/Qwen3-8B-128K-Q4_K_M.gguf",
         "Qwen3-8B-128K Q4_K_M"),
        ("/x/models--unsloth--Qwen3-8B-GGUF/snapshots/c/UD-Q4_K_XL/"
         "Qwen3-8B-UD-Q4_K_XL-00001-of-00002.gguf", "Qwen3-8B UD-Q4_K_XL"),
        # A bare file: its name and quant; a name whose tag is not its end, whole.
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct Q4_1"),
        ("/d/demo-tiny-Q4_K_M-s0.gguf", "demo-tiny-Q4_K_M-s0"),
        ("/d/model.gguf", "model"),
        # A content-addressed blob (Ollama) says nothing: the file's own name for itself.
        ("/o/models/blobs/sha256-" + "0" * 64, "Smollm2 135M"),
    ],
)  # fmt: skip
def test_the_name_users_know_a_model_by(path: str, shown: str) -> None:
    assert display_name(Path(path), fallback="Smollm2 135M") == shown


def test_the_repository_is_read_off_the_hub_cache_and_lm_studio_paths() -> None:
    assert repo_of(Path(f"{HF}/f.gguf")) == "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    assert repo_of(Path(f"{STUDIO}/f.gguf")) == "lmstudio-community/Meta-Llama-3-8B-Instruct-GGUF"
    assert repo_of(Path("/srv/models/acme/thing/f.gguf")) is None


def test_a_file_is_shown_by_its_name_not_general_name(tiny_model: Path) -> None:
    info = read_gguf(tiny_model)
    assert info.name.startswith("localchat-demo-tiny")  # what the file calls itself
    assert info.display_name == "tiny Q4_K_M"  # tiny-Q4_K_M.gguf
