"""Layering rules: the runtime never imports Textual, and only engine.py touches llama_cpp."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


# Runtime modules that the planner, the catalog and listings stand on: they load neither
# llama.cpp nor numpy (a plan or a model list never pays for either).
LIGHT_MODULES = (
    "atomic", "backend", "catalog", "chat_formats", "chat_template", "cpu", "errors",
    "estimate", "gguf_info", "locks", "paths", "planner", "prompt", "quants", "reasoning",
    "remote", "speed", "stops", "store", "text", "units", "window",
)  # fmt: skip


PROBE = (
    "import json, sys, {name}; print(json.dumps(sorted(m for m in sys.modules"
    " if m.split('.')[0] in ('numpy', 'llama_cpp', 'textual') or m.startswith('localchat.tui'))))"
)


def _loaded_by(name: str) -> list[str]:
    """What importing ``name`` in a fresh interpreter loads of the heavy packages."""
    command = [sys.executable, "-c", PROBE.format(name=name)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(result.stdout)
    return loaded


def test_each_runtime_module_imports_only_what_its_layer_allows() -> None:
    with ThreadPoolExecutor(4) as pool:
        loaded = dict(zip(RUNTIME_MODULES, pool.map(_loaded_by, RUNTIME_MODULES), strict=True))
    for name, modules in loaded.items():
        roots = {m.split(".")[0] for m in modules}
        assert "textual" not in roots, f"{name} pulls in Textual"
        assert not [m for m in modules if m.startswith("localchat.tui")], f"{name} loads the app"
        if name.removeprefix("localchat.") in LIGHT_MODULES:
            assert not roots & {"numpy", "llama_cpp"}, f"{name} loads {sorted(roots)}"
    assert "localchat.bench" in loaded and "localchat.planner" in loaded
    assert "llama_cpp" in {m.split(".")[0] for m in loaded["localchat.engine"]}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _localchat_imports(path: Path, modules: set[str]) -> set[str]:
    """The localchat modules a source file imports, at module level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                names.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n in modules}


def test_no_import_cycles() -> None:
    paths = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _localchat_imports(p, modules) for p in paths}
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append([*trail[trail.index(target) :], target])
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == [], f"import cycles: {cycles}"
    assert "localchat.hardware" in graph["localchat.planner"]


def test_only_remote_speaks_http_to_servers_and_the_app_loads_it_only_for_one() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if _imports(path) & {"httpx", "httpx_sse"}
        # the bare client; the package index, read only while the starter model is fetched
        and path.name not in ("remote.py", "bench_remote.py", "starter.py")
    ]
    assert offenders == []
    code = "import sys, localchat.tui.app, localchat.cli; print('httpx' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"  # a local start never pays for the wire
