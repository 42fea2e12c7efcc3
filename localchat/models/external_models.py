"""GGUF files other tools already keep, usable by name without copying.

LM Studio keeps plain GGUF files under ``~/.lmstudio/models`` (older versions:
``~/.cache/lm-studio/models``) as ``publisher/repo/file.gguf``. Ollama keeps content-addressed
blobs under ``~/.ollama/models`` (or ``$OLLAMA_MODELS``) with a manifest per ``name:tag``
whose model layer is a GGUF blob. Any other folder can be added (``models --scan DIR``).
Nothing here is written to; a folder or manifest that cannot be read is skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from localchat.gguf.info import is_later_split_part, is_projector

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class ExternalModel:
    name: str
    path: Path
    source: str  # "lm studio" | "ollama" | "folder"


def lm_studio_dirs(home: Path) -> list[Path]:
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def ollama_dir(home: Path) -> Path:
    configured = os.environ.get("OLLAMA_MODELS")
    return Path(configured).expanduser() if configured else home / ".ollama" / "models"


def scan_folder(root: Path, source: str) -> list[ExternalModel]:
    """Every chat-model GGUF below ``root`` (projectors and later split parts left out),
    named by its path below ``root``."""
    if not root.is_dir():
        return []
    found = []
    try:
        paths = sorted(root.rglob("*.gguf"))
    except OSError:
        return []
    for path in paths:
        if is_projector(path.name) or is_later_split_part(path.name):
            continue
        name = path.relative_to(root).with_suffix("").as_posix()
        found.append(ExternalModel(name, path, source))
    return found


def ollama_models(root: Path) -> list[ExternalModel]:
    """``name:tag`` for every manifest whose model layer is a blob on disk."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    found = []
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        parts = manifest.relative_to(manifests).parts  # registry, namespace, name, tag
        if len(parts) < 3:
            continue
        *_, namespace, model, tag = parts
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        digest = next(
            (
                layer.get("digest")
                for layer in layers
                if layer.get("mediaType") == OLLAMA_MODEL_LAYER
            ),
            None,
        )
        if not isinstance(digest, str):
            continue
        blob = root / "blobs" / digest.replace(":", "-")
        name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        if blob.exists():
            found.append(ExternalModel(name, blob, "ollama"))
    return found


def discover(home: Path, folders: list[Path]) -> list[ExternalModel]:
    """LM Studio's and Ollama's models, then those in the user's own folders."""
    found: list[ExternalModel] = []
    for directory in lm_studio_dirs(home):
        found += scan_folder(directory, "lm studio")
    found += ollama_models(ollama_dir(home))
    for folder in folders:
        found += scan_folder(folder, "folder")
    return found
