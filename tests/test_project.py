"""Project hygiene: the README's commands are the ones CI runs; lint and types are clean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks if b.strip().startswith("python3 -m venv")]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    launch, tests = commands
    assert launch.endswith("localchat --demo")
    assert tests.endswith("python -m pytest")
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert tests in ci_script


def _tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_ruff_lint_and_format_are_clean() -> None:
    lint = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_on_the_runtime_is_clean() -> None:
    result = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_modules_stay_small_and_the_app_composes() -> None:
    """A module has one job: none past ~600 lines; the app only composes its screens."""
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in (ROOT / "localchat").rglob("*.py")
    }
    assert {name: lines for name, lines in sizes.items() if lines > 600} == {}
    assert sizes["localchat/tui/app.py"] <= 500


def test_the_readme_build_reads_images() -> None:
    """The README builds llama-cpp-python with libmtmd: a build without it (a wheel pip
    cached from an older install) would skip every image test without a word."""
    from localchat.backends.llama.vision import mtmd_unavailable

    assert mtmd_unavailable() is None, mtmd_unavailable()
