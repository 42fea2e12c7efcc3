"""Where ``serve``'s router gets its models: the names each is served under (from the
library, as ``localchat models`` lists them, or the files and names given), and how one is
loaded (``models.loader``, as the app loads it) with what memory allows: its sequences,
their context and KV type, and the memory the same estimate as ``hw`` says it takes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from localchat.backends.compute_thread import run_compute
from localchat.errors import LocalchatError
from localchat.gguf.estimate import LayerWeights, ModelDims, estimate_memory
from localchat.gguf.info import read_gguf
from localchat.gguf.names import display_name
from localchat.models.hardware import Hardware, detect_hardware
from localchat.models.launch import LaunchOptions
from localchat.models.library import Library, ModelRow
from localchat.models.loader import ModelLoader
from localchat.models.planner import Plan, plan_file
from localchat.models.projectors import chosen_projector, projector_memory_bytes
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
        others = (*_catalog_names(row), row.model, Path(row.path).stem)
        unlisted = tuple(dict.fromkeys(a for a in others if a not in taken and a != name))
        taken.update((name, *unlisted))
        entry = ServedEntry(name, Path(row.path), unlisted=unlisted)
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


def _catalog_names(row: ModelRow) -> tuple[str, ...]:
    """``NAME:QUANT``, as ``pull`` and ``--model`` take a catalog or hub model."""
    if row.source in ("catalog", "hub cache") and row.quant and ":" not in row.model:
        return (f"{row.model}:{row.quant}",)
    return ()


@functools.cache
def _hardware() -> Hardware:
    """This machine (its GPU probed once); the memory free is read at each plan."""
    return detect_hardware()


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
        # Replies are decoded side by side, each drafting by prompt lookup where it pays;
        # a projector beside a model is loaded with it (its images decoded into the
        # sequences' own context: ``SequenceBatch.decode_image``).
        self.launch = replace(launch, lookup_only=True, own_cells=OWN_CELLS, draft_model=None)
        self.loader = ModelLoader(paths)
        self.states = states
        self.parallel = parallel
        self.warn = warn

    def _wanted_ctx(self, path: Path) -> int:
        """The context asked (``--ctx``), else ``DEFAULT_SERVE_CTX``; at most the model's
        trained context (one ``--ctx`` serves models trained for less)."""
        trained = read_gguf(path).context_length
        wanted = self.launch.n_ctx or DEFAULT_SERVE_CTX
        return min(wanted, trained) if trained else wanted

    def _plan(self, path: Path) -> Plan:
        """What ``hw`` plans for ``path`` in the memory left now: the context (halved until
        it fits where none was asked), the KV cache's type, the attention kernel, the
        micro-batch."""
        hardware = replace(_hardware(), ram_available_bytes=self.free_bytes() + RESERVE_BYTES)
        return plan_file(
            path, hardware, self._wanted_ctx(path), projector_bytes=self._projector_bytes(path)
        )

    def _projector_bytes(self, path: Path) -> int:
        """What the projector the load will open beside ``path`` takes (0: none)."""
        projector = chosen_projector(path, self.launch.projector)
        return projector_memory_bytes(projector) if projector else 0

    def _launch(self, path: Path, plan: Plan) -> LaunchOptions:
        """The launch options with what the plan chose: never a larger KV type than the one
        asked (settings.toml's), the context asked where one was, else the plan's."""
        launch = self.launch
        wanted = self._wanted_ctx(path)
        if not plan.fits:  # the router made what room there is: as asked
            return replace(launch, n_ctx=wanted)
        frugal = launch.kv_type in (None, "f16") and plan.kv_type != "f16"
        return replace(
            launch, n_ctx=wanted if launch.n_ctx else plan.n_ctx,
            kv_type=plan.kv_type if frugal else launch.kv_type,
            flash_attn=plan.flash_attn, n_ubatch=plan.n_ubatch,
        )  # fmt: skip

    def load(self, entry: ServedEntry) -> ModelRunner:
        launch = self._launch(entry.path, self._plan(entry.path))
        engine = self.loader.load(entry.path, launch, self.warn)
        try:
            parallel = self.parallel or default_parallel(engine, self.free_bytes())
            return ModelRunner(engine, self.states, entry.name, parallel=parallel,
                               aliases=entry.answers_to[1:])  # fmt: skip
        except BaseException:
            run_compute(engine.close)
            raise

    def needed_bytes(self, entry: ServedEntry) -> int:
        """The plan's estimate for one sequence (more only where memory allows them)."""
        plan = self._plan(entry.path)
        if plan.estimate is not None:
            return plan.estimate.ram_required + self._projector_bytes(entry.path)
        info = read_gguf(entry.path)
        estimate = estimate_memory(
            ModelDims.from_gguf(info), LayerWeights.from_gguf(info), plan.n_ctx,
            self.launch.kv_type or "f16",
        )  # fmt: skip
        return estimate.ram_required

    def free_bytes(self) -> int:
        return max(0, psutil.virtual_memory().available - RESERVE_BYTES)
