"""The runtime's layers as package contracts: each package imports only the layers below it,
the runtime never imports Textual, one package (backends/llama) touches llama_cpp, no cycles.

Layers, lowest first (README, Development):
    leaves        errors, atomic, paths, units, text, cpu, progress, heap
    gguf/         facts about a file
    chat/         text and token ids
    state/        what is stored
    backends/     who writes a reply (backends/llama: the only llama_cpp importer)
    conversation/ and models/   a turn over any backend; what to run here (neither sees the other)
    tools/                      MCP servers, consent, results (beside them: chat text only)
    settings, session           the lifecycle
    server/                     ``serve``: the model over HTTP
    tui/                        the app, on the runtime (it never serves, runs commands or benches)
    cli/, bench/                on top: the commands (``localchat`` starts the app, ``bench`` the
                                bench), and the bench, which measures the app and the command

Only the command imports server/ and bench/. Textual is imported by tui/ and bench/app/ (the
app's own measurements, which the bench imports only when it measures the app) alone.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import localchat

PACKAGE = Path(localchat.__file__).parent


def _is_app(path: Path) -> bool:
    """Whether a source file is the app's (Textual's) code: tui/, and bench/app/."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] == "tui" or parts[:2] == ("bench", "app")


RUNTIME_MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.name != "__init__.py" and not _is_app(p)
)
LEAVES = {"errors", "atomic", "paths", "units", "text", "cpu", "progress", "heap"}
# What each part of the runtime may import from localchat (besides itself).
BELOW: dict[str, set[str]] = {
    "leaves": {"leaves"},
    "gguf": {"leaves"},
    "chat": {"leaves", "gguf"},
    "state": {"leaves", "gguf", "chat"},
    "backends": {"leaves", "gguf", "chat", "state"},
    "conversation": {"leaves", "gguf", "chat", "state", "backends"},
    "models": {"leaves", "gguf", "chat", "state", "backends"},
    "tools": {"leaves", "chat"},
    "settings": {"leaves", "gguf", "chat", "state", "backends", "models", "tools"},
    "session": {"leaves", "gguf", "chat", "state", "backends", "conversation", "models",
                "settings", "tools"},
    "server": {"leaves", "gguf", "chat", "state", "backends", "conversation", "models",
               "settings", "session", "tools"},
}  # fmt: skip
RUNTIME = set(BELOW)
# The top floors. The app sits on the runtime but never serves; the commands start the app,
# the server and the bench; the bench measures the app and the command (its startup probe
# imports what the command imports). So nothing but cli imports bench or server.
BELOW |= {
    "tui": RUNTIME - {"server"},
    "cli": RUNTIME | {"tui", "bench"},
    "bench": RUNTIME - {"server"} | {"tui", "cli"},
    "__main__": {"cli"},  # ``python -m localchat``
}
# The app's own floors (tui/), lowest first: its leaf modules (messages, pacing, ...), the
# widgets that own their state (composer, transcript, reply view, ...), the chat screen's
# parts (chat/: the turn worker, the tool round), the screens, and the app on top. Type-only
# imports count too: a widget never names a screen.
TUI_LEAVES = {"bindings", "messages", "pacing", "process", "worker_failures", "state"}
TUI_BELOW: dict[str, set[str]] = {
    "leaves": set(),
    "widgets": {"leaves"},
    "chat": {"leaves", "widgets"},
    "screens": {"leaves", "widgets", "chat"},
    "app": {"leaves", "widgets", "chat", "screens"},
}


def _part(module: str) -> str:
    """The layer a module belongs to: its package, a leaf, or a top-level module's name."""
    parts = module.split(".")
    if len(parts) == 2:
        return "leaves" if parts[1] in LEAVES else parts[1]
    return parts[1]


def _tui_floor(module: str) -> str:
    """The floor of the app a tui module is on: a leaf, its sub-package, or ``app``."""
    parts = module.split(".")[2:]
    if len(parts) == 1:
        return "leaves" if parts[0] in TUI_LEAVES else parts[0]
    return parts[0]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _nodes(tree: ast.AST, typing_too: bool) -> list[ast.AST]:
    """Every node, or every node outside ``if TYPE_CHECKING:`` blocks."""
    if typing_too:
        return list(ast.walk(tree))
    found: list[ast.AST] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _localchat_imports(path: Path, modules: set[str], typing_too: bool = True) -> set[str]:
    """The localchat modules a source file imports, at module level or inside functions
    (``typing_too=False``: not those imported for type hints only)."""
    names: set[str] = set()
    for node in _nodes(ast.parse(path.read_text()), typing_too):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                names.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n in modules}


def _graph(typing_too: bool = True) -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _localchat_imports(p, modules, typing_too) for p in paths}


def _crossings(graph: dict[str, set[str]], floor: Callable[[str], str]) -> set[tuple[str, str]]:
    """Each (floor, floor) pair some module's import crosses."""
    return {
        (floor(module), floor(target))
        for module, targets in graph.items()
        for target in targets
        if floor(target) != floor(module)
    }


def test_each_layer_imports_only_the_layers_below_it() -> None:
    graph = _graph()
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _part(module) in BELOW
        for target in targets
        if _part(target) != _part(module) and _part(target) not in BELOW[_part(module)]
    ]
    assert upward == []
    # The contracts hold something: the layers are there and use what is below them.
    assert "localchat.backends.llama.engine" in graph["localchat.conversation.local"]
    assert "localchat.backends.llama.tools" in graph["localchat.models.calibrate"]
    assert {_part(m) for m in graph} >= set(BELOW)
    assert {
        ("tui", "session"),
        ("cli", "server"),
        ("cli", "tui"),
        ("cli", "bench"),
        ("bench", "tui"),
        ("bench", "cli"),
        ("__main__", "cli"),
    } <= _crossings(graph, _part)


def test_the_apps_floors_import_only_the_floors_below_them() -> None:
    graph = {m: {t for t in ts if t.startswith("localchat.tui.")}
             for m, ts in _graph().items() if m.startswith("localchat.tui.")}  # fmt: skip
    floors = {_tui_floor(m) for m in graph}
    assert floors == set(TUI_BELOW), f"floors TUI_BELOW does not place: {floors - set(TUI_BELOW)}"
    crossings = _crossings(graph, _tui_floor)
    upward = sorted(f"{a} -> {b}" for a, b in crossings if b not in TUI_BELOW[a])
    assert upward == []
    assert {("app", "screens"), ("app", "leaves"), ("screens", "widgets"),
            ("screens", "chat"), ("widgets", "leaves"), ("chat", "leaves")} <= crossings  # fmt: skip


def test_only_backends_llama_imports_llama_cpp() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "llama_cpp" in _imports(path)
        and path.relative_to(PACKAGE).parts[:2] != ("backends", "llama")
    ]
    assert offenders == []
    assert "llama_cpp" in _imports(PACKAGE / "backends" / "llama" / "engine.py")


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
    assert "localchat.backends.llama.engine" in RUNTIME_MODULES
    assert "localchat.cli.main" in RUNTIME_MODULES


def test_runtime_source_has_no_textual_import() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if not _is_app(p) and "textual" in _imports(p)
    ]
    assert offenders == []
    assert "textual" in _imports(PACKAGE / "bench" / "app" / "measure.py")


# Runtime modules that the planner, the catalog and listings stand on: they load neither
# llama.cpp nor numpy (a plan or a model list never pays for either).
LIGHT_MODULES = (
    "atomic", "backends.base", "models.catalog", "chat.formats", "chat.template", "cpu",
    "errors", "gguf.estimate", "gguf.info", "state.locks", "paths", "models.planner",
    "chat.prompt", "gguf.quants", "chat.reasoning", "backends.remote", "models.speed",
    "chat.stops", "state.store", "text", "units", "chat.window", "backends.servers",
)  # fmt: skip


PROBE = (
    "import json, sys, {name}; print(json.dumps(sorted(m for m in sys.modules"
    " if m.split('.')[0] in ('numpy', 'llama_cpp', 'textual', 'mcp')"
    " or m.startswith('localchat.tui'))))"
)


def _loaded_by(name: str) -> list[str]:
    """What importing ``name`` in a fresh interpreter loads of the heavy packages."""
    command = [sys.executable, "-c", PROBE.format(name=name)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(result.stdout)
    return loaded


def test_each_runtime_module_loads_only_what_its_layer_allows() -> None:
    with ThreadPoolExecutor(4) as pool:
        loaded = dict(zip(RUNTIME_MODULES, pool.map(_loaded_by, RUNTIME_MODULES), strict=True))
    for name, modules in loaded.items():
        roots = {m.split(".")[0] for m in modules}
        assert "textual" not in roots, f"{name} pulls in Textual"
        assert "mcp" not in roots, f"{name} imports the MCP SDK (only a configured server may)"
        assert not [m for m in modules if m.startswith("localchat.tui")], f"{name} loads the app"
        if name.removeprefix("localchat.") in LIGHT_MODULES:
            assert not roots & {"numpy", "llama_cpp"}, f"{name} loads {sorted(roots)}"
    assert "localchat.bench.run" in loaded and "localchat.models.planner" in loaded
    assert "llama_cpp" in {m.split(".")[0] for m in loaded["localchat.backends.llama.engine"]}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle a depth-first walk of ``graph`` meets, each as a trail of modules."""
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
    return cycles


def test_no_import_cycles() -> None:
    # Imports for type hints only are left out here: no cycle when run (the next test).
    graph = _graph(typing_too=False)
    assert _cycles(graph) == [], f"import cycles: {_cycles(graph)}"
    assert "localchat.models.hardware" in graph["localchat.models.planner"]


def test_no_import_cycles_even_through_type_hints() -> None:
    # A part is handed what it reads (a generation its cache, context and vocabulary; a
    # remote reply and a turn a protocol of what they ask of their parent), so no module
    # names its parent even in a type hint: each can be read, and moved, on its own.
    graph = _graph(typing_too=True)
    assert _cycles(graph) == [], f"type-only cycles: {_cycles(graph)}"
    assert "localchat.backends.llama.cache" in graph["localchat.backends.llama.generation"]
    assert "localchat.conversation.turn" in graph["localchat.conversation.base"]


def test_only_the_remote_backend_speaks_http_to_servers_and_a_local_start_never_loads_it() -> None:
    allowed = {
        "backends/remote.py",  # the wire to servers
        "bench/remote.py",  # the bare client it is measured against
        "bench/serve.py",  # the plain client `localchat serve` is read with
        "models/starter.py",  # the package index, read only while the starter model is fetched
    }
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if _imports(path) & {"httpx", "httpx_sse"}
        and path.relative_to(PACKAGE).as_posix() not in allowed
    ]
    assert offenders == []
    code = (
        "import sys, localchat.tui.app, localchat.cli.main;"
        " print(sorted({'httpx', 'starlette', 'uvicorn'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]"  # a local start never pays for the wire or serve


def _llama_cpp_private_names() -> set[str]:
    """The private attributes llama-cpp-python's ``Llama`` and its wrappers of llama.cpp's
    model, context and batch set on themselves (read from its installed source)."""
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.origin is not None
    folder = Path(spec.origin).parent
    names: set[str] = set()
    for source in ("llama.py", "_internals.py"):
        for node in ast.walk(ast.parse((folder / source).read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                names.add(node.attr)
    return names


class _PrivateReads(ast.NodeVisitor):
    """Where a module reaches into llama-cpp-python's private attributes: ``x._ctx`` on any
    object but ``self``, and ``self._ctx`` too inside a class built on llama-cpp-python's
    (``RecordingLlama(llama_cpp.Llama)``); a class of localchat's own may name its own
    attributes as it likes."""

    def __init__(self, private: set[str]) -> None:
        self.private = private
        self.llama_class = [False]
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = " ".join(ast.unparse(base) for base in node.bases)
        self.llama_class.append("llama_cpp" in bases or "Llama" in bases)
        self.generic_visit(node)
        self.llama_class.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        own = isinstance(node.value, ast.Name) and node.value.id == "self"
        if node.attr in self.private and (not own or self.llama_class[-1]):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def test_only_the_internals_module_touches_llama_cpp_private_attributes() -> None:
    # One module holds every use of llama-cpp-python's private attributes (each a small
    # function saying what public API is missing): a release that renames one breaks it alone.
    private = _llama_cpp_private_names()
    assert {"_model", "_ctx", "_batch", "_requires_eval"} <= private
    internals = PACKAGE / "backends" / "llama" / "internals.py"
    offenders: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        reads = _PrivateReads(private)
        reads.visit(ast.parse(path.read_text()))
        if path != internals:
            offenders += [f"{path.relative_to(PACKAGE)}:{n}: {text}" for n, text in reads.found]
        else:
            assert reads.found, "the internals module is where they are read"
    assert offenders == []
