"""The model catalog: ``models.toml`` at the repo root plus the user's own in the config dir.

Entries carry everything planning needs offline; a malformed file or entry is an error that
names the file, the entry and the field.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from localchat.chat.formats import BUILTIN
from localchat.errors import UsageError
from localchat.gguf.estimate import ModelDims, VisionTower, swa_pattern_of
from localchat.gguf.info import is_projector
from localchat.gguf.quants import parse_tag, quality_rank

# The repo's top-level models.toml is the source; the package holds it (a link in the source
# tree, a copy in every built wheel), so every install reads the same catalog.
REPO_CATALOG = Path(str(resources.files("localchat") / "models.toml"))

_INT_FIELDS = ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab", "context_length")

KINDS = ("chat", "embedding")


def chat_models(models: list[CatalogModel]) -> list[CatalogModel]:
    """The entries a chat can run (an embedding model only answers embeddings)."""
    return [m for m in models if m.kind == "chat"]


class CatalogError(UsageError):
    """A catalog file that cannot be used as it is."""


@dataclass(frozen=True)
class QuantFile:
    quant: str
    file: str
    size: int


@dataclass(frozen=True)
class CatalogModel:
    name: str
    repo: str
    architecture: str
    dims: ModelDims
    files: tuple[QuantFile, ...]  # in quality order, best first
    source: str
    template: str | None = None  # a built-in chat format or a .jinja file overriding the GGUF's
    draft: str | None = None  # a smaller catalog model of the same family that drafts for it
    kind: str = "chat"  # "embedding": served for embeddings, never offered as a chat model
    projectors: tuple[QuantFile, ...] = ()  # a vision model's mmproj files, best first
    tower: VisionTower | None = None  # their vision tower's numbers: an encode's memory

    @property
    def vision(self) -> bool:
        """Reads images: the catalog names its projector (pulled and planned with it)."""
        return bool(self.projectors)

    def file_for(self, quant: str) -> QuantFile | None:
        return next((f for f in self.files if f.quant == quant), None)

    @property
    def quants(self) -> list[str]:
        return [f.quant for f in self.files]


def _fail(path: Path, entry: str, field: str, problem: str) -> CatalogError:
    return CatalogError(f"{path}: model {entry!r}: field {field!r} {problem}")


def _parse_model(path: Path, index: int, raw: Any) -> CatalogModel:
    """One ``[[model]]`` entry, checked field by field; the first bad one raises, naming
    the file, the entry and the field."""
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: entry {index + 1} is not a table")
    name = raw.get("name")
    entry = name if isinstance(name, str) and name else f"#{index + 1}"
    for field in ("name", "repo", "architecture"):
        if not isinstance(raw.get(field), str) or not raw[field].strip():
            raise _fail(path, entry, field, "must be a non-empty string")
    for field in _INT_FIELDS:
        value = raw.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(path, entry, field, "must be a positive integer")
    window = raw.get("sliding_window", 0)
    if not isinstance(window, int) or window < 0:
        raise _fail(path, entry, "sliding_window", "must be 0 or a positive integer")
    files = _parse_files(path, entry, raw.get("files"))
    projectors = _parse_projectors(path, entry, raw.get("mmproj"))
    tower = _parse_tower(path, entry, raw.get("vision")) if projectors else None
    head_dim = raw["head_dim"]
    dims = ModelDims(
        raw["n_layer"],
        raw["n_embd"],
        raw["n_head"],
        raw["n_head_kv"],
        head_dim,
        head_dim,
        raw["n_vocab"],
        raw["context_length"],
        window,
        swa_pattern_of(raw["architecture"]),
    )
    template = _parse_template(path, entry, raw.get("template"))
    kind = raw.get("kind", "chat")
    if kind not in KINDS:
        raise _fail(path, entry, "kind", f"must be one of {', '.join(KINDS)}")
    draft = raw.get("draft")
    if draft is not None and (not isinstance(draft, str) or not draft.strip()):
        raise _fail(path, entry, "draft", "must be the name of another catalog model")
    return CatalogModel(
        raw["name"], raw["repo"], raw["architecture"], dims, tuple(files), str(path), template,
        draft, kind, tuple(projectors), tower,
    )  # fmt: skip


def _parse_files(path: Path, entry: str, files_raw: Any, field: str = "files") -> list[QuantFile]:
    """An entry's ``files`` (or ``mmproj``) table (quant = { file, size }), best first."""
    if not isinstance(files_raw, dict) or not files_raw:
        raise _fail(path, entry, field, "must be a table of quant = { file, size }")
    files = []
    for quant, spec in files_raw.items():
        tag = parse_tag(quant)
        if tag is None:
            raise _fail(
                path,
                entry,
                f"{field}.{quant}",
                "is not a quant tag llama.cpp knows (e.g. Q4_K_M, IQ4_XS, UD-Q4_K_XL)",
            )
        if not isinstance(spec, dict) or not isinstance(spec.get("file"), str):
            raise _fail(path, entry, f"{field}.{quant}.file", "must be a file name")
        size = spec.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise _fail(path, entry, f"{field}.{quant}.size", "must be a positive number of bytes")
        files.append(QuantFile(tag.tag, spec["file"], size))
    files.sort(key=lambda f: quality_rank(f.quant))
    return files


def _parse_projectors(path: Path, entry: str, raw: Any) -> list[QuantFile]:
    """An entry's ``mmproj`` table (precision = { file, size }): the vision projectors a
    pull may bring with the model; none for a text model. Each must be a projector file
    (``mmproj-*``), as the hub listing and ``pull --mmproj`` know them."""
    if raw is None:
        return []
    projectors = _parse_files(path, entry, raw, "mmproj")
    for projector in projectors:
        if not is_projector(projector.file):
            raise _fail(
                path,
                entry,
                f"mmproj.{projector.quant}.file",
                f"names {projector.file!r}, not a vision projector (mmproj-*.gguf)",
            )
    return projectors


_TOWER_FIELDS = ("image_size", "patch_size", "n_embd", "n_ff", "n_head")


def _parse_tower(path: Path, entry: str, raw: Any) -> VisionTower:
    """A vision entry's ``vision`` table: its tower's numbers (the projector's
    ``clip.vision`` keys), which size an image's encode before anything is downloaded."""
    if not isinstance(raw, dict):
        raise _fail(path, entry, "vision", f"must be a table of {', '.join(_TOWER_FIELDS)}")
    for field in _TOWER_FIELDS:
        value = raw.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(path, entry, f"vision.{field}", "must be a positive integer")
    return VisionTower(*(raw[field] for field in _TOWER_FIELDS))


def _parse_template(path: Path, entry: str, template: Any) -> str | None:
    """An entry's ``template``: a built-in format's name, or a .jinja file (a relative path
    is taken from the catalog's folder); None: the model file's own."""
    if template is None:
        return None
    if not isinstance(template, str) or not template.strip():
        raise _fail(path, entry, "template", "must be a format name or a .jinja file")
    if template not in BUILTIN:
        template = str((path.parent / template).expanduser())  # relative to the catalog
    return template


def load_catalog_file(path: Path) -> list[CatalogModel]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read the catalog ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: not valid TOML ({exc})") from None
    entries = data.get("model", [])
    if not isinstance(entries, list):
        raise CatalogError(f"{path}: [[model]] entries expected")
    models = [_parse_model(path, i, raw) for i, raw in enumerate(entries)]
    seen: set[str] = set()
    for model in models:
        if model.name in seen:
            raise CatalogError(f"{path}: model {model.name!r} appears twice")
        seen.add(model.name)
    return models


def load_catalog(
    user_catalog: Path | None = None, repo_catalog: Path = REPO_CATALOG
) -> list[CatalogModel]:
    """The repo's catalog with the user's entries added (same name: the user's wins)."""
    models = {m.name: m for m in load_catalog_file(repo_catalog)} if repo_catalog.exists() else {}
    if user_catalog is not None and user_catalog.exists():
        for model in load_catalog_file(user_catalog):
            models[model.name] = model
    for model in models.values():
        if model.draft is not None and (model.draft not in models or model.draft == model.name):
            raise _fail(
                Path(model.source),
                model.name,
                "draft",
                f"names {model.draft!r}, not another catalog model",
            )
    return list(models.values())


def catalog_template(model_file: Path, user_catalog: Path | None) -> str | None:
    """The template a catalog entry names for this downloaded file, if any. A catalog that
    cannot be read names none here (listing and planning report it)."""
    try:
        models = load_catalog(user_catalog)
    except CatalogError:
        return None
    for model in models:
        if model.template and any(f.file == model_file.name for f in model.files):
            return model.template
    return None


def catalog_draft(model_file: Path, user_catalog: Path | None) -> CatalogModel | None:
    """The draft model the catalog names for this downloaded file's model, if any (a
    catalog that cannot be read names none here: listing and planning report it)."""
    try:
        models = load_catalog(user_catalog)
    except CatalogError:
        return None
    for model in models:
        if model.draft and any(f.file == model_file.name for f in model.files):
            return find_model(models, model.draft)
    return None


def find_model(models: list[CatalogModel], name: str) -> CatalogModel:
    """The entry called ``name``; the error lists the closest names."""
    for model in models:
        if model.name == name:
            return model
    import difflib

    near = difflib.get_close_matches(name, [m.name for m in models], n=3, cutoff=0.3)
    hint = f"did you mean {', '.join(near)}?" if near else "`localchat models` lists them"
    raise UsageError(f"no model named {name!r} in the catalog; {hint}")
