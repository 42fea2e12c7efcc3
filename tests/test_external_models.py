"""Models the user already has: LM Studio's and Ollama's, and any folder, listed and usable
by name without copying (layouts built in the isolated home)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from localchat.cli.main import main


def _layouts(home: Path, tiny_model: Path) -> dict[str, Path]:
    studio = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    studio.mkdir(parents=True)
    shutil.copy(tiny_model, studio / "tiny-Q4_K_M.gguf")
    (studio / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF projector")
    old = home / ".cache" / "lm-studio" / "models" / "old" / "Old-GGUF"
    old.mkdir(parents=True)
    shutil.copy(tiny_model, old / "old-Q4_K_M-00001-of-00002.gguf")
    shutil.copy(tiny_model, old / "old-Q4_K_M-00002-of-00002.gguf")
    ollama = home / ".ollama" / "models"
    digest = hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    (ollama / "blobs").mkdir(parents=True)
    blob = ollama / "blobs" / f"sha256-{digest}"
    shutil.copy(tiny_model, blob)
    library = ollama / "manifests" / "registry.ollama.ai" / "library"
    manifest = {
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
        ]
    }
    (library / "tiny").mkdir(parents=True)
    (library / "tiny" / "latest").write_text(json.dumps(manifest))
    (library / "broken").mkdir(parents=True)
    (library / "broken" / "latest").write_text("{not json")
    user = ollama / "manifests" / "registry.ollama.ai" / "me" / "thing"
    user.mkdir(parents=True)
    (user / "7b").write_text(json.dumps(manifest))
    return {"studio": studio / "tiny-Q4_K_M.gguf", "ollama": blob}


def _rows(capsys, *extra: str) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["models", "--json", *extra]) == 0
    return {r["model"]: r for r in json.loads(capsys.readouterr().out)}


def test_lm_studio_and_ollama_models_are_listed(isolated_home: Path, tiny_model: Path, capsys):
    where = _layouts(isolated_home, tiny_model)
    rows = _rows(capsys)
    studio = rows["lmstudio-community/Tiny-GGUF/tiny-Q4_K_M"]
    assert (studio["source"], studio["path"], studio["quant"]) == (
        "lm studio",
        str(where["studio"]),
        "Q4_K_M",
    )
    assert rows["old/Old-GGUF/old-Q4_K_M-00001-of-00002"]["source"] == "lm studio"
    assert not [m for m in rows if "00002-of" in m or "mmproj" in m]
    assert rows["tiny:latest"]["source"] == "ollama"
    assert rows["tiny:latest"]["path"] == str(where["ollama"])
    assert rows["me/thing:7b"]["source"] == "ollama"
    assert "broken:latest" not in rows


def test_they_are_usable_by_name(isolated_home: Path, tiny_model: Path, capsys) -> None:
    _layouts(isolated_home, tiny_model)
    for name in ("tiny:latest", "lmstudio-community/Tiny-GGUF/tiny-Q4_K_M"):
        capsys.readouterr()
        assert main(["ask", "hi", "--model", name, "--max-tokens", "2", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["stats"]["generated_tokens"] == 2


def test_models_scan_adds_a_folder_for_good(tmp_path: Path, tiny_model: Path, capsys) -> None:
    folder = tmp_path / "my models"
    (folder / "sub").mkdir(parents=True)
    shutil.copy(tiny_model, folder / "sub" / "mine-Q4_K_M.gguf")
    rows = _rows(capsys, "--scan", str(folder))
    assert rows["sub/mine-Q4_K_M"]["source"] == "folder"
    assert "sub/mine-Q4_K_M" in _rows(capsys)  # remembered
    assert main(["models", "--scan", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
