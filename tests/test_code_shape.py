"""The code's shape as tests: a private name stays in its module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import localchat

PACKAGE = Path(localchat.__file__).parent


def _sources() -> Iterator[tuple[str, ast.Module]]:
    """Each source file under localchat/, as its path there and its parsed tree."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _module_of(relative: str) -> str:
    """The dotted module name of a path under localchat/ (a package is its __init__)."""
    parts = Path(relative).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("localchat", *parts))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_name() -> None:
    offenders = [
        f"{relative}:{node.lineno}: from {node.module} import {alias.name}"
        for relative, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module is not None
        and node.module.split(".")[0] == "localchat"
        and node.module != _module_of(relative)
        for alias in node.names
        if _is_private(alias.name)
    ]
    assert offenders == [], "private names used outside their module:\n" + "\n".join(offenders)
