"""Layering rules: the runtime never imports Textual, and only engine.py touches llama_cpp."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import localchat

PACKAGE = Path(localchat.__file__).parent
RUNTIME_MODULES = sorted(
    f"localchat.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem not in {"__init__", "__main__"}
)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_modules_import_without_textual() -> None:
    code = (
        "import sys\n"
        f"for name in {RUNTIME_MODULES!r}: __import__(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"runtime pulled in Textual: {result.stdout}"
    assert "localchat.engine" in RUNTIME_MODULES and "localchat.cli" in RUNTIME_MODULES


def test_only_engine_imports_llama_cpp() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "llama_cpp" in _imports(path) and path.name != "engine.py"
    ]
    assert offenders == []
    assert "llama_cpp" in _imports(PACKAGE / "engine.py")


def test_runtime_source_has_no_textual_import() -> None:
    offenders = [p.name for p in PACKAGE.glob("*.py") if "textual" in _imports(p)]
    assert offenders == []
