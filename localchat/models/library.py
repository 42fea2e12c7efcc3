"""The user's models: what can be pulled, what is on disk, and what fits this machine.

Glues the catalog, the planner and the hub: ``pull`` picks the planner's quant when none is
given, ``models`` lists catalog quants with their fit and download state, plus every GGUF in
the hub cache and every file added by hand.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from localchat.atomic import write_atomic
from localchat.errors import ModelFileError, UsageError
from localchat.gguf.estimate import LayerWeights, ModelDims
from localchat.gguf.info import is_later_split_part, is_projector, read_gguf
from localchat.gguf.quants import is_good_enough
from localchat.models.catalog import CatalogModel, find_model, load_catalog
from localchat.models.catalog_vision import catalog_projector, planned_projector_bytes
from localchat.models.draft_plan import DraftPlan, plan_draft
from localchat.models.external_models import ExternalModel, discover
from localchat.models.hardware import Hardware, repacked_weight_types
from localchat.models.hub import (
    Downloader,
    HubCache,
    HubError,
    RemoteFile,
    choose_file,
    choose_projector,
    file_size,
    list_gguf_files,
    normal_tag,
    quant_of,
    remote_gguf_header,
)
from localchat.models.planner import (
    DEFAULT_CTX,
    MIN_TOKENS_PER_S,
    Candidate,
    Plan,
    fit_label,
    less_ram,
    plan_with_projector,
    sized_candidates,
)
from localchat.models.speed import SpeedModel, TokenWork, load_speed_model
from localchat.paths import AppPaths
from localchat.progress import ProgressCallback
from localchat.units import format_bytes


@dataclass(frozen=True)
class ModelSpec:
    """What ``pull``/``rm`` were asked for: a catalog entry or a repo, and maybe a quant."""

    repo: str
    quant: str | None
    catalog: CatalogModel | None


def parse_spec(text: str, catalog: list[CatalogModel]) -> ModelSpec:
    """``name[:QUANT]`` or ``org/repo[:QUANT]``; unknown names list the closest ones."""
    name, _, quant_text = text.partition(":")
    quant = normal_tag(quant_text) if quant_text else None
    if "/" in name:
        entry = next((m for m in catalog if m.repo == name), None)
        return ModelSpec(name, quant, entry)
    entry = find_model(catalog, name)  # raises with near names
    if quant is not None and entry.file_for(quant) is None:
        raise UsageError(f"{entry.name} has no {quant}; it has {', '.join(entry.quants)}")
    return ModelSpec(entry.repo, quant, entry)


@dataclass
class ModelRequest:
    """A model name as the user gave it, parsed once where it comes in (``Library.request``)
    and handed on: a file added by hand or another tool's model (``path``), else a catalog
    name or hub repo (``spec``). What is worked out for it — the planner's pick, the file
    chosen — is kept on it, so one start asks the hub and the planner once (again only
    once the speed calibration it was planned with changed)."""

    text: str
    spec: ModelSpec | None = None
    path: Path | None = None
    resolved: tuple[str, str, str] | None = field(default=None, repr=False)
    plan: Plan | None = field(default=None, repr=False)
    planned_with: SpeedModel | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ModelRow:
    """One line of ``localchat models``."""

    model: str
    quant: str
    file: str
    size_bytes: int
    estimated_bytes: int | None
    fit: str  # "GPU" | "RAM" | "too big" | "unknown" | "projector" | "partial"
    downloaded: bool
    path: str | None
    source: str  # "catalog" | "hub cache" | "local" | "demo" | "lm studio" | "ollama" | "folder"
    problem: str | None = None  # why the file cannot be used (moved, truncated, corrupt…)
    file_type: str | None = None  # the weights' type from the file's metadata, when read
    predicted_gen_tps: float | None = None  # on this machine's calibration
    planned: bool = False  # the planner's pick for its model here
    plan: str | None = None  # the planner's pick for its model and why (catalog rows)
    kind: str = "chat"  # "embedding": a catalog embedding model (never loaded as a chat)
    vision: bool = False  # a catalog vision model: its projector comes with a pull

    @property
    def usable(self) -> bool:
        return self.downloaded and self.path is not None and self.problem is None


class Library:
    def __init__(
        self,
        paths: AppPaths,
        hardware: Hardware,
        speed: SpeedModel | None = None,
        min_tps: float = MIN_TOKENS_PER_S,
    ) -> None:
        """``speed`` defaults to this machine's saved calibration (none: plans by memory)."""
        self.paths = paths
        self.hardware = hardware
        self.speed = speed or load_speed_model(paths.speed_calibration)
        self.min_tps = min_tps
        self.catalog = load_catalog(paths.user_catalog)
        self.cache = HubCache(paths.hub_cache)

    # -- local files added by hand ----------------------------------------------------------
    def local_models(self) -> dict[str, str]:
        path = self.paths.local_models
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: unreadable ({exc}); fix or delete it") from None
        return {str(k): str(v) for k, v in data.items()}

    # -- models other tools keep, and folders the user named ---------------------------------
    def scan_dirs(self) -> list[Path]:
        path = self.paths.scan_dirs
        if not path.exists():
            return []
        try:
            return [Path(p) for p in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError) as exc:
            raise UsageError(f"{path}: unreadable ({exc}); fix or delete it") from None

    def add_scan_dir(self, folder: Path) -> Path:
        """List the GGUF files in ``folder`` from now on (the files stay where they are)."""
        folder = folder.expanduser().resolve()
        if not folder.is_dir():
            raise UsageError(f"{folder} is not a folder; give a folder of .gguf files")
        folders = self.scan_dirs()
        if folder not in folders:
            folders.append(folder)
            payload = json.dumps([str(f) for f in folders], indent=2).encode()
            write_atomic(self.paths.scan_dirs, payload)
        return folder

    def external_models(self) -> list[ExternalModel]:
        return discover(self.paths.other_tools_home, self.scan_dirs())

    def add_local(self, path: Path, name: str | None = None) -> str:
        info = read_gguf(path)  # refuses anything that is not a readable GGUF
        name = name or path.stem
        models = self.local_models()
        models[name] = str(path.resolve())
        write_atomic(self.paths.local_models, json.dumps(models, indent=2).encode())
        return f"added {name} ({info.architecture}, {info.file_type})"

    # -- a model asked for by name ---------------------------------------------------------
    def request(self, text: str) -> ModelRequest:
        """``text`` parsed once: a name added by hand or another tool's model, else
        ``name[:QUANT]`` or ``org/repo[:QUANT]`` (an unknown name is refused with the
        closest ones)."""
        local = self.local_models()
        if text in local:
            return ModelRequest(text, path=Path(local[text]))
        external = {m.name: m.path for m in self.external_models()}
        if text in external:
            return ModelRequest(text, path=external[text])
        return ModelRequest(text, spec=parse_spec(text, self.catalog))

    def resolve(self, request: ModelRequest) -> tuple[str, str, str]:
        """(repo, filename, quant) to download for ``request``."""
        self._forget_stale(request)
        if request.resolved is None:
            request.resolved = self._resolve(request)
        return request.resolved

    def _resolve(self, request: ModelRequest) -> tuple[str, str, str]:
        spec = request.spec
        if spec is None:
            raise UsageError(f"{request.text} is a file on this machine, not a hub model")
        if spec.catalog is not None and spec.repo == spec.catalog.repo:
            entry = spec.catalog
            quant = spec.quant or self._catalog_plan(request).quant
            quant_file = entry.file_for(quant)
            if quant_file is None:
                raise UsageError(f"{entry.name} has no {quant}; it has {', '.join(entry.quants)}")
            return entry.repo, quant_file.file, quant
        files = list_gguf_files(spec.repo)
        if not files:
            raise UsageError(f"{spec.repo} has no GGUF files; localchat runs GGUF models only")
        preferred = [] if spec.quant else self._planned_order(spec.repo, files)
        chosen = choose_file(files, spec.quant, preferred)
        return chosen.repo, chosen.filename, chosen.quant

    def plan_of(self, request: ModelRequest) -> Plan | None:
        """The planner's pick for a catalog name, with why (None for other names)."""
        spec = request.spec
        if spec is None or spec.catalog is None or spec.quant is not None:
            return None
        return self._catalog_plan(request)

    def _catalog_plan(self, request: ModelRequest) -> Plan:
        """The planner's pick among a catalog entry's files (worked out once per request)."""
        self._forget_stale(request)
        if request.plan is None:
            assert request.spec is not None and request.spec.catalog is not None
            entry = request.spec.catalog
            files = ((f.quant, f.file, f.size) for f in entry.files)
            projector = planned_projector_bytes(entry)
            request.plan = self._fitting_plan(entry.name, entry.dims, files, projector)
        return request.plan

    def _forget_stale(self, request: ModelRequest) -> None:
        """A pick made before the speed calibration came is made again with it."""
        if request.planned_with is not self.speed:
            request.plan, request.resolved, request.planned_with = None, None, self.speed

    def _planned_order(self, repo: str, files: list[RemoteFile]) -> list[str]:
        """The planner's pick for a repo outside the catalog, from one file's remote header."""
        smallest = min(files, key=lambda f: f.size)
        dims = ModelDims.from_gguf(remote_gguf_header(repo, smallest.filename))
        plan = self._fitting_plan(repo, dims, ((f.quant, f.filename, f.size) for f in files))
        return [plan.quant]

    def _fitting_plan(
        self,
        name: str,
        dims: ModelDims,
        files: Iterable[tuple[str, str, int]],
        projector_bytes: int = 0,
    ) -> Plan:
        """The planner's pick (a vision model's with its projector), refused if none fits."""
        candidates = sized_candidates(dims, files)
        plan = plan_with_projector(
            name, dims, candidates, self.hardware, DEFAULT_CTX, self.speed, self.min_tps,
            projector_bytes,
        )  # fmt: skip
        if not plan.fits:
            raise UsageError(f"{name} does not fit this machine: {plan.explanation}")
        return plan

    def pull(
        self,
        request: ModelRequest,
        on_progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> Path:
        repo, filename, _quant = self.resolve(request)
        return Downloader(self.cache).pull(repo, filename, on_progress=on_progress, cancel=cancel)

    def hub_problem(self, request: ModelRequest) -> str | None:
        """Why ``request`` cannot be downloaded now (the hub unreachable, offline, no such
        model), or None when it can: a quick question asked before a first start spends
        time on anything else."""
        try:
            repo, filename, _quant = self.resolve(request)
            Downloader(self.cache).check(repo, filename)
        except HubError as exc:
            return str(exc)
        return None

    def projector_for(self, request: ModelRequest) -> RemoteFile:
        """The vision projector that goes with the model ``request`` names: the one the
        catalog names for a catalog vision model, else the repo's."""
        repo, _filename, quant = self.resolve(request)
        entry = request.spec.catalog if request.spec is not None else None
        if entry is not None and entry.repo == repo and entry.vision:
            chosen = catalog_projector(entry, quant)
            assert chosen is not None  # a vision entry names at least one
            return chosen
        return choose_projector(repo, list_gguf_files(repo, projectors=True), quant)

    def pull_projector(
        self,
        projector: RemoteFile,
        on_progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> Path:
        """Fetch a projector: only when asked, never taken by a quant tag alone."""
        return Downloader(self.cache).pull(
            projector.repo, projector.filename, on_progress=on_progress, cancel=cancel
        )

    def draft_path(self, text: str) -> Path:
        """The draft model asked for by name or file: a file, or any downloaded quant of a
        model (the best; ``name:QUANT`` for one)."""
        if text.endswith(".gguf") or Path(text).expanduser().is_file():
            return Path(text).expanduser()
        request = self.request(text)
        spec = request.spec
        if spec is None or spec.quant:  # a file added by hand or a quant named
            found = self.path_of(request)
        else:
            found = self._downloaded_of(spec.repo)
        if found is None:
            raise UsageError(
                f"draft model {text} is not downloaded; `localchat pull {text}` fetches it"
            )
        return found

    def draft_plan(
        self, target: Path, draft: CatalogModel, n_ctx: int, kv_type: str
    ) -> DraftPlan | None:
        """The catalog's ``draft`` for ``target``, where a file of it is downloaded: whether
        it fits beside it and pays here."""
        path = self._downloaded_of(draft.repo)
        if path is None:
            return None
        return self.plan_for_draft(target, path, n_ctx, kv_type)

    def plan_for_draft(self, target: Path, draft: Path, n_ctx: int, kv_type: str) -> DraftPlan:
        """Whether the draft file at ``draft`` fits beside ``target`` and pays here."""
        return plan_draft(target, draft, self.hardware, n_ctx, kv_type, self.speed)

    def _downloaded_of(self, repo: str) -> Path | None:
        """A downloaded model file of ``repo`` to draft with: the fastest (smallest) of the
        quants that keep quality, else the smallest."""
        files = [
            (name, path)
            for r, name, path in self.cache.downloaded()
            if r == repo and not is_projector(name) and not is_later_split_part(name)
        ]
        if not files:
            return None

        def rank(item: tuple[str, Path]) -> tuple[bool, int]:
            quant = quant_of(item[0]) or ""
            return (not is_good_enough(quant), item[1].stat().st_size)

        return min(files, key=rank)[1]

    def path_of(self, request: ModelRequest) -> Path | None:
        """The downloaded (or added) file for a model asked for, if it is on disk."""
        if request.path is not None:
            return request.path
        spec = request.spec
        assert spec is not None
        for repo, filename, path in self.cache.downloaded():
            if repo != spec.repo:
                continue
            quant = spec.quant or (self._catalog_plan(request).quant if spec.catalog else None)
            if quant is None or quant_of(filename) == quant:
                return path
        return None

    def remove(self, text: str, projector: bool = False) -> list[Path]:
        """Delete exactly the download ``text`` names (its vision projector with
        ``projector``); an ambiguous name is refused with the candidates."""
        local = self.local_models()
        if text in local:
            del local[text]
            write_atomic(self.paths.local_models, json.dumps(local, indent=2).encode())
            return [Path(text)]
        spec = parse_spec(text, self.catalog)
        on_disk = [(repo, name) for repo, name, _path in self.cache.downloaded()]
        on_disk += [(p.repo, p.filename) for p in self.cache.partials()]
        targets = sorted(
            {
                (repo, name)
                for repo, name in on_disk
                if repo == spec.repo
                and (spec.quant is None or quant_of(name) == spec.quant)
                # A split set goes with its first part; a projector is not the model named.
                and not is_later_split_part(name)
                and is_projector(name) == projector
            }
        )
        if not targets:
            raise UsageError(f"{text} is not downloaded; `localchat models` shows what is")
        if spec.quant is None and len(targets) > 1:
            names = ", ".join(f"{spec.repo}:{quant_of(name)}" for _repo, name in targets)
            raise UsageError(f"{text} names {len(targets)} downloads; say which: {names}")
        removed: list[Path] = []
        for repo, name in targets:
            removed += self.cache.remove(repo, name)
        return removed

    # -- models ------------------------------------------------------------------------------
    def rows(self, n_ctx: int = DEFAULT_CTX) -> list[ModelRow]:
        downloaded = {(repo, name): path for repo, name, path in self.cache.downloaded()}
        rows = []
        for entry in self.catalog:
            ctx = min(n_ctx, entry.dims.context_length)
            files = [(f.quant, f.file, f.size) for f in entry.files]
            candidates = sized_candidates(entry.dims, files)
            projector = planned_projector_bytes(entry)
            plan = plan_with_projector(
                entry.name, entry.dims, candidates, self.hardware, ctx, self.speed, self.min_tps,
                projector,
            )  # fmt: skip
            room = less_ram(self.hardware, projector)
            for quant_file, candidate in zip(entry.files, candidates, strict=True):
                fit, estimate, speed = fit_label(entry.dims, candidate, room, ctx, self.speed)
                estimate += projector
                path = downloaded.pop((entry.repo, quant_file.file), None)
                rows.append(
                    ModelRow(
                        entry.name, quant_file.quant, quant_file.file, quant_file.size, estimate, fit,
                        path is not None, str(path) if path else None, "catalog",
                        predicted_gen_tps=round(speed.gen_tps, 1) if speed else None,
                        planned=plan.fits and plan.quant == quant_file.quant,
                        plan=plan.explanation,
                        kind=entry.kind,
                        vision=entry.vision,
                    )
                )  # fmt: skip
        extra = [
            (repo, name, path, "hub cache")
            for (repo, name), path in downloaded.items()
            if not is_later_split_part(name)  # a split set is one model, listed by its first
        ]
        extra += [
            (name, Path(path).name, Path(path), "local")
            for name, path in self.local_models().items()
        ]
        extra += [(m.name, m.path.name, m.path, m.source) for m in self.external_models()]
        for model, name, path, source in extra:
            rows.append(self._file_row(model, name, path, source, n_ctx))
        for partial in self.cache.partials():
            tag = quant_of(partial.filename)
            flag = " --mmproj" if is_projector(partial.filename) else ""
            rows.append(
                ModelRow(
                    partial.repo, tag, partial.filename, partial.bytes_done, None, "partial",
                    False, None, "hub cache",
                    f"a stopped download ({format_bytes(partial.bytes_done)} so far):"
                    f" `localchat pull {partial.repo}:{tag}{flag}` resumes it, `localchat rm` deletes it",
                )
            )  # fmt: skip
        return rows

    def _file_row(self, model: str, name: str, path: Path, source: str, n_ctx: int) -> ModelRow:
        tag = quant_of(name)
        if is_projector(name):
            return ModelRow(
                model, tag, name, file_size(path), None, "projector", path.exists(),
                str(path), source, "a vision projector: it goes with a chat model, it is not one",
            )  # fmt: skip
        try:
            info = read_gguf(path)
        except (ModelFileError, UsageError) as exc:  # one row that says why; the rest stand
            return ModelRow(
                model, "unknown", name, 0, None, "unknown", path.exists(), str(path), source,
                str(exc),
            )  # fmt: skip
        dims = ModelDims.from_gguf(info)
        weights = LayerWeights.from_gguf(info, repacked_weight_types())
        ctx = min(n_ctx, dims.context_length) if dims.context_length else n_ctx
        candidate = Candidate(info.file_type, name, weights, TokenWork.of(info))
        fit, estimate, speed = fit_label(dims, candidate, self.hardware, ctx, self.speed)
        size = path.stat().st_size
        # The tag as published (UD-Q4_K_XL…), else the type the file says it holds.
        quant = tag if tag != "unknown" else info.file_type
        return ModelRow(
            model, quant, name, size, estimate, fit, True, str(path), source, None, info.file_type,
            round(speed.gen_tps, 1) if speed else None,
        )  # fmt: skip
