"""The app's own layers: widgets ← chat parts ← screens ← app, no import pointing back up (a
widget never imports a screen; screens may import widgets). Type-only imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import localchat.tui

TUI = Path(localchat.tui.__file__).parent
# Lowest first; a module may import the tui modules of its own layer and those below.
LAYERS = ("base", "widgets", "chat", "screens", "app", "probes")
BASE = {"messages", "pacing", "bindings", "worker_failures", "state", "process"}
PROBES = {"bench_ui", "startup_probe"}  # they drive the whole app


def _layer(module: str) -> str:
    """The layer of ``localchat.tui.<...>``."""
    parts = module.split(".")[2:]
    if not parts or parts == ["__init__"]:
        return "base"
    if parts[0] in ("widgets", "chat", "screens"):
        return parts[0]
    if parts[0] in BASE:
        return "base"
    if parts[0] in PROBES:
        return "probes"
    assert parts[0] == "app", f"a tui module in no layer: {module}"
    return "app"


def _tui_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("localchat.tui.")}


def test_no_tui_import_points_up() -> None:
    upward = []
    for path in sorted(TUI.rglob("*.py")):
        module = ".".join(path.relative_to(TUI.parent.parent).with_suffix("").parts)
        rank = LAYERS.index(_layer(module))
        upward += [
            f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
            for target in sorted(_tui_imports(path))
            if LAYERS.index(_layer(target)) > rank
        ]
    assert upward == []
