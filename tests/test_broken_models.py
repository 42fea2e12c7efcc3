"""Nothing unreadable breaks a list: a moved, truncated, corrupt or old-version GGUF is one
row that says why, and the app's start goes on to the next usable model."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from localchat.cli.main import main
from localchat.paths import app_paths
from localchat.tui.messages import ModelLoaded

from .tui_helpers import chat_app

BROKEN = {
    "old": (b"GGUF" + struct.pack("<I", 1) + b"\0" * 64, "unsupported GGUF version 1"),
    "corrupt": (
        b"GGUF" + struct.pack("<IQQ", 3, 5, 10**15) + b"x" * 100,
        "corrupt GGUF header",
    ),
    "truncated": (None, "truncated GGUF header"),
    "moved": (None, "no such file"),
}


def _library_with_broken_files(tmp_path: Path, tiny_model: Path, capsys) -> Path:
    for name, (data, _why) in BROKEN.items():
        path = tmp_path / f"{name}.gguf"
        shutil.copy(tiny_model, path)
        assert main(["add", str(path), "--name", name]) == 0
        if name == "truncated":
            path.write_bytes(tiny_model.read_bytes()[:5000])
        elif name == "moved":
            path.unlink()
        else:
            path.write_bytes(data)
    good = tmp_path / "good.gguf"
    shutil.copy(tiny_model, good)
    assert main(["add", str(good), "--name", "good"]) == 0
    # And a truncated download in the hub cache.
    snapshot = app_paths().hub_cache / "models--acme--cut-GGUF" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "cut-Q4_K_M.gguf").write_bytes(tiny_model.read_bytes()[:3000])
    capsys.readouterr()
    return good


def test_each_broken_file_is_one_row_that_says_why(
    tmp_path: Path, tiny_model: Path, capsys
) -> None:
    _library_with_broken_files(tmp_path, tiny_model, capsys)
    assert main(["models", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    for name, (_data, why) in BROKEN.items():
        assert why in rows[name]["problem"], name
    assert "truncated GGUF header" in rows["acme/cut-GGUF"]["problem"]
    assert rows["good"]["problem"] is None and rows["good"]["quant"] == "Q4_K_M"
    assert any(r["source"] == "catalog" for r in rows.values())  # the rest of the list stands
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert table.count("unusable:") == len(BROKEN) + 1


async def test_the_app_starts_on_the_next_usable_model(
    tmp_path: Path, tiny_model: Path, capsys, calibrated: object
) -> None:
    good = _library_with_broken_files(tmp_path, tiny_model, capsys)
    async with chat_app(ready=False, n_ctx=256, max_tokens=4) as ui:
        loaded = await ui.wait_for(ModelLoaded)
        assert loaded.backend.model_path == good
        assert (await ui.notice("skipped old: ")).startswith("skipped old: ")
