"""The code's shape as tests: a private name stays in its module, and a function stays short
enough to read at once (the few longer ones are named, each with its reason)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import localchat

PACKAGE = Path(localchat.__file__).parent
MAX_FUNCTION_LINES = 60
# Functions allowed over MAX_FUNCTION_LINES: "path::qualname" (path under localchat/).
LONGER: dict[str, str] = {}


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


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method in ``tree`` by its qualified name (``Class.method``,
    ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _function_lengths() -> dict[str, int]:
    return {
        f"{relative}::{name}": node.end_lineno - node.lineno + 1
        for relative, tree in _sources()
        for name, node in _functions(tree)
        if node.end_lineno is not None
    }


def test_no_function_is_longer_than_the_limit() -> None:
    lengths = _function_lengths()
    long = [
        f"{key} ({lines} lines)"
        for key, lines in sorted(lengths.items())
        if lines > MAX_FUNCTION_LINES and key not in LONGER
    ]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_each_longer_function_is_still_there_and_still_long() -> None:
    lengths = _function_lengths()
    stale = [
        f"{key} ({f'{lengths[key]} lines' if key in lengths else 'gone'})"
        for key in sorted(LONGER)
        if lengths.get(key, 0) <= MAX_FUNCTION_LINES
    ]
    assert stale == [], "LONGER entries to remove:\n" + "\n".join(stale)
    assert all(reason.strip() for reason in LONGER.values())
    assert "state/store.py::Store.add_message" in lengths  # methods by their class
