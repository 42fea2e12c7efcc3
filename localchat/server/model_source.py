"""Where ``serve``'s router gets its models: the names each is served under (from the
library, as ``localchat models`` lists them, or the files and names given), and how one is
loaded (``models.loader``, as the app loads it) with what memory allows: its sequences,
their context and KV type, and the memory the same estimate as ``hw`` says it takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from localchat.backends.compute_thread import run_compute
from localchat.errors import LocalchatError
from localchat.gguf.estimate import LayerWeights, ModelDims, estimate_memory
from localchat.gguf.info import read_gguf
from localchat.gguf.names import display_name
from localchat.models.launch import LaunchOptions
from localchat.models.library import Library, ModelRow
from localchat.models.loader import ModelLoader
from localchat.paths import AppPaths
from localchat.server.router import ServedEntry
from localchat.server.runner import ModelRunner, default_parallel
from localchat.state.kvstate import StateStore

DEFAULT_SERVE_CTX = 4096  # a sequence's context where none is asked (the trained, if less)
OWN_CELLS = 256  # the engine's own context: it only warms the model up
RESERVE_BYTES = 512 * 1024 * 1024  # memory left to the rest of the machine


def library_entries(library: Library) -> tuple[list[ServedEntry], list[ServedEntry]]:
    """Every usable model in the library (projectors aside), served under the name users
    know it by (``display_name``) and reached also by the names ``localchat models`` shows:
    ``NAME:QUANT``, and for a model's first file the bare ``NAME``; and its file's stem.
    The chat models, and the embedding models (a pooling type in the file)."""
    entries: list[ServedEntry] = []
    embedding: list[ServedEntry] = []
    taken: set[str] = set()
    for row in library.rows():
        if not row.usable or row.fit == "projector" or row.path is None:
            continue
        name = display_name(row.path)
        if name in taken:
            continue
        others = (_listed_name(row), row.model, Path(row.path).stem)
        aliases = tuple(dict.fromkeys(a for a in others if a not in taken and a != name))
        taken.update((name, *aliases))
        entry = ServedEntry(name, Path(row.path), aliases)
        (embedding if _embeds(row) else entries).append(entry)
    return entries, embedding


def _embeds(row: ModelRow) -> bool:
    """An embedding model: the catalog says so, or the file has a pooling type."""
    if row.kind == "embedding":
        return True
    try:
        return read_gguf(Path(row.path or "")).arch_value("pooling_type") is not None
    except LocalchatError:
        return False


def _listed_name(row: ModelRow) -> str:
    return f"{row.model}:{row.quant}" if row.quant and ":" not in row.model else row.model


class LibrarySource:
    """Loads a served model (a ``RunnerSource``): the launch options the user gave (the
    settings fill the rest), each sequence's context, and as many sequences as memory
    allows (``default_parallel``) unless ``parallel`` says."""

    def __init__(
        self,
        paths: AppPaths,
        launch: LaunchOptions,
        states: StateStore,
        parallel: int | None = None,
        warn: Callable[[str], object] | None = None,
    ) -> None:
        # Replies are decoded side by side, each drafting by prompt lookup where it pays.
        self.launch = replace(launch, lookup_only=True, own_cells=OWN_CELLS, draft_model=None)
        self.loader = ModelLoader(paths)
        self.states = states
        self.parallel = parallel
        self.warn = warn

    def _n_ctx(self, path: Path) -> int:
        if self.launch.n_ctx:
            return self.launch.n_ctx
        trained = read_gguf(path).context_length
        return min(DEFAULT_SERVE_CTX, trained) if trained else DEFAULT_SERVE_CTX

    def load(self, entry: ServedEntry) -> ModelRunner:
        launch = replace(self.launch, n_ctx=self._n_ctx(entry.path))
        engine = self.loader.load(entry.path, launch, self.warn)
        try:
            parallel = self.parallel or default_parallel(engine, self.free_bytes())
            return ModelRunner(engine, self.states, entry.name, parallel=parallel,
                               aliases=entry.aliases)  # fmt: skip
        except BaseException:
            run_compute(engine.close)
            raise

    def needed_bytes(self, entry: ServedEntry) -> int:
        info = read_gguf(entry.path)
        cells = self._n_ctx(entry.path) * (self.parallel or 1)
        estimate = estimate_memory(
            ModelDims.from_gguf(info), LayerWeights.from_gguf(info), cells,
            self.launch.kv_type or "f16",
        )  # fmt: skip
        return estimate.ram_required

    def free_bytes(self) -> int:
        return max(0, psutil.virtual_memory().available - RESERVE_BYTES)
