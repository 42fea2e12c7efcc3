"""A regular (non-editable) install has everything: the catalog ships inside the wheel."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_the_catalog_and_an_install_reads_it(tmp_path: Path) -> None:
    out = tmp_path / "wheel"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*build, "--quiet", "-w", str(out), str(ROOT)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    wheel = next(out.glob("localchat-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("localchat/models.toml") == (ROOT / "models.toml").read_bytes()
        assert "localchat/tui/app.tcss" in archive.namelist()
        archive.extractall(site)
    # The installed copy (not the source tree) lists the catalog.
    code = (
        "import localchat, localchat.models.catalog as c;"
        "print(localchat.__file__); print(len(c.load_catalog()))"
    )
    listed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert listed.returncode == 0, listed.stderr
    location, count = listed.stdout.split()
    assert location.startswith(str(site))
    entries = tomllib.loads((ROOT / "models.toml").read_text())["model"]
    assert int(count) == len(entries) > 0
