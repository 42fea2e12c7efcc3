"""Models from the hub: resolve a name, download with progress, resume, verify, list, remove.

Files land in huggingface-hub's standard cache layout (``models--org--name/blobs``,
``snapshots/<commit>/<file>``, ``refs/<revision>``), so other tools that use the hub cache
see them and localchat sees theirs. The transfer itself is localchat's own loop over the
hub client's HTTP session, because it must stop on request within a chunk and leave a
partial ``<sha>.incomplete`` blob that the next pull resumes with a range request. A
finished file is checked against the hub's size and sha256, then its GGUF header, before it
is ever named in the cache: a damaged file is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx2 as httpx  # huggingface-hub 2.x ships httpx2, its fork of httpx
from filelock import FileLock
from huggingface_hub import (
    HfApi,
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_url,
    scan_cache_dir,
)
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import (
    OfflineModeIsEnabled,
    build_hf_headers,
    hf_raise_for_status,
    http_backoff,
)

from localchat.atomic import write_atomic
from localchat.errors import LocalchatError, ModelFileError, UsageError, WorldError
from localchat.gguf.info import SPLIT_RE, GGUFInfo, is_projector, read_gguf, read_gguf_url
from localchat.gguf.quants import parse_tag, quality_rank, tag_of_file
from localchat.progress import Progress, ProgressCallback
from localchat.units import format_bytes

CHUNK_BYTES = 1024 * 1024
RETRIES = 3
DISK_MARGIN_BYTES = 256 * 1024 * 1024


class HubError(WorldError):
    """The hub could not be reached or refused; the message says what to do."""


class DownloadCancelled(LocalchatError):
    """Stopped on request; the partial file stays and the next pull resumes it."""


def hub_endpoint() -> str:
    """Read at call time, so ``HF_ENDPOINT`` set after import (tests, a mirror) applies."""
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    filename: str
    size: int
    quant: str


def quant_of(filename: str) -> str:
    """The file's quant tag as published (``UD-Q4_K_XL``, ``BF16``…), or "unknown"."""
    tag = tag_of_file(filename)
    return tag.tag if tag else "unknown"


def normal_tag(quant: str) -> str:
    """A quant the user typed, spelled as tags are compared (exactly, any case)."""
    tag = parse_tag(quant)
    return tag.tag if tag else quant.upper()


def offline() -> bool:
    """HF_HUB_OFFLINE, read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


OFFLINE_MESSAGE = (
    "offline mode is on (HF_HUB_OFFLINE=1): unset it to reach the hub,"
    " or use a model on disk (`localchat models` lists them)"
)


def _hub_error(exc: Exception, what: str) -> LocalchatError:
    if isinstance(exc, OfflineModeIsEnabled) or offline():
        return HubError(f"{what}: {OFFLINE_MESSAGE}")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"{what}: no such repository on the hub ({hub_endpoint()})")
    if isinstance(exc, EntryNotFoundError):
        return HubError(f"{what}: no such file on the hub")
    if isinstance(exc, httpx.TransportError | OSError):
        return HubError(
            f"cannot reach the hub at {hub_endpoint()} ({exc.__class__.__name__}); check the network,"
            " or chat with a file you have: --model-path FILE.gguf"
        )
    return HubError(f"{what}: the hub answered {exc}")


def remote_gguf_header(repo: str, filename: str, revision: str = "main") -> GGUFInfo:
    """A GGUF file's header on the hub, read with range requests through huggingface_hub's
    own session (HF_TOKEN, proxies, retries on 5xx/429): planning costs the header's bytes."""
    what = f"{repo}/{filename}"
    if offline():
        raise HubError(f"{what}: {OFFLINE_MESSAGE}")
    url = hf_hub_url(repo, filename, revision=revision, endpoint=hub_endpoint())
    headers = build_hf_headers()

    def fetch(start: int, length: int) -> tuple[bytes, int | None]:
        ranged = {**headers, "Range": f"bytes={start}-{start + length - 1}"}
        try:
            response = http_backoff(
                "GET", url, headers=ranged, follow_redirects=True, max_retries=3
            )
            if response.status_code == 416:  # past the end of the file
                return b"", None
            hf_raise_for_status(response)
        except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
            raise _hub_error(exc, what) from None
        if response.status_code != 206:
            raise ModelFileError(f"{what}: the server does not answer range requests")
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        return response.content, int(total) if total.isdigit() else None

    return read_gguf_url(url, fetch)


def list_gguf_files(
    repo: str, revision: str = "main", projectors: bool = False
) -> list[RemoteFile]:
    """The repo's GGUF chat models with sizes (split sets by their first part, sized whole),
    or with ``projectors`` its vision projectors instead."""
    if offline():
        raise HubError(f"{repo}: {OFFLINE_MESSAGE}")
    api = HfApi(endpoint=hub_endpoint())
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
        raise _hub_error(exc, repo) from None
    siblings = info.siblings or []
    files = []
    for sibling in siblings:
        name = sibling.rfilename
        if not name.endswith(".gguf") or is_projector(name) != projectors:
            continue
        split = SPLIT_RE.search(name)
        if split and split.group(1) != "00001":
            continue
        size = sibling.size or 0
        if split:  # the whole set's size
            prefix = name[: split.start()]
            size = sum(
                s.size or 0
                for s in siblings
                if s.rfilename.startswith(prefix) and SPLIT_RE.search(s.rfilename)
            )
        files.append(RemoteFile(repo, name, size, quant_of(name)))
    return files


def choose_projector(repo: str, projectors: list[RemoteFile], model_quant: str) -> RemoteFile:
    """The projector to go with a model: the model's own tag if published, else the best
    of F16/BF16/F32 (what vision models ship), else the smallest."""
    if not projectors:
        raise UsageError(f"{repo} has no vision projector (mmproj-*.gguf) to fetch")
    for wanted in (model_quant, "F16", "BF16", "F32"):
        for remote in projectors:
            if remote.quant == wanted:
                return remote
    return min(projectors, key=lambda f: f.size)


def split_parts(filename: str) -> list[str]:
    """All files of a split GGUF set (``x-00001-of-00003.gguf`` → three names)."""
    match = SPLIT_RE.search(filename)
    if not match:
        return [filename]
    total = int(match.group(2))
    prefix = filename[: match.start()]
    return [f"{prefix}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]


class HubCache:
    """huggingface-hub's cache folder, read and written in its own layout."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def repo_dir(self, repo: str) -> Path:
        return self.root / repo_folder_name(repo_id=repo, repo_type="model")

    def snapshot_path(self, repo: str, filename: str, revision: str = "main") -> Path | None:
        """The finished file if it is in the cache."""
        ref = self.repo_dir(repo) / "refs" / revision
        commit = ref.read_text().strip() if ref.exists() else revision
        path = self.repo_dir(repo) / "snapshots" / commit / filename
        return path if path.exists() else None

    def downloaded(self) -> list[tuple[str, str, Path]]:
        """(repo, filename, path) of every GGUF file in the cache."""
        found: list[tuple[str, str, Path]] = []
        if not self.root.exists():
            return found
        for repo_dir in sorted(self.root.glob("models--*")):
            repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
            for path in sorted(repo_dir.glob("snapshots/*/**/*.gguf")):
                if path.exists():
                    relative = path.relative_to(
                        next(p for p in path.parents if p.parent.name == "snapshots")
                    )
                    found.append((repo, relative.as_posix(), path))
        return found

    def locks_dir(self, repo: str) -> Path:
        """huggingface_hub's per-file locks for a repo (a folder its cache scan skips); the
        records of stopped downloads live beside them."""
        return self.root / ".locks" / repo_folder_name(repo_id=repo, repo_type="model")

    def note_partial(self, repo: str, etag: str, filename: str) -> None:
        """Remember which file a ``<etag>.incomplete`` blob is, so that ``rm`` and ``models``
        can name a partial download without asking the hub."""
        records = self.locks_dir(repo)
        records.mkdir(parents=True, exist_ok=True)
        write_atomic(records / f"{etag}.partial", filename.encode())

    def forget_partial(self, repo: str, etag: str) -> None:
        (self.locks_dir(repo) / f"{etag}.partial").unlink(missing_ok=True)

    def partials(self) -> list[PartialDownload]:
        """Downloads that were stopped part way (the next pull of the same file resumes)."""
        found = []
        for record in sorted(self.root.glob(".locks/models--*/*.partial")):
            repo = record.parent.name.removeprefix("models--").replace("--", "/", 1)
            etag = record.name.removesuffix(".partial")
            blob = self.repo_dir(repo) / "blobs" / f"{etag}.incomplete"
            if blob.exists():
                found.append(PartialDownload(repo, record.read_text(), etag, file_size(blob)))
        return found

    def remove(self, repo: str, filename: str) -> list[Path]:
        """Delete exactly this file (every part of a split set) through huggingface_hub's
        cache API: a blob that another file or revision shares stays; a partial download of
        the same file goes too."""
        names = set(split_parts(filename))
        removed: list[Path] = []
        if self.root.exists():
            info = scan_cache_dir(self.root)
            files = [
                cached
                for cached_repo in info.repos
                if cached_repo.repo_id == repo and cached_repo.repo_type == "model"
                for revision in cached_repo.revisions
                for cached in revision.files
                if cached.file_path.relative_to(revision.snapshot_path).as_posix() in names
            ]
            strategy = info.delete_files(*files)
            strategy.execute()
            removed += sorted(strategy.files) + sorted(strategy.blobs)
        # A repo the scan calls corrupt (a dangling link) is cleaned link by link.
        for name in names:
            for link in self.repo_dir(repo).glob(f"snapshots/*/{name}"):
                if link.is_symlink() and not link.exists():
                    link.unlink()
                    removed.append(link)
        for partial in self.partials():
            if partial.repo == repo and partial.filename in names:
                blob = self.repo_dir(repo) / "blobs" / f"{partial.etag}.incomplete"
                blob.unlink(missing_ok=True)
                self.forget_partial(repo, partial.etag)
                removed.append(blob)
        return removed


@dataclass(frozen=True)
class PartialDownload:
    """A ``<etag>.incomplete`` blob and the file it will become."""

    repo: str
    filename: str
    etag: str
    bytes_done: int


@dataclass(frozen=True)
class _FileMeta:
    filename: str
    url: str
    size: int
    sha256: str | None
    etag: str
    commit: str


@dataclass(frozen=True)
class _PullRun:
    """What a pull's files share: the cache's blobs folder, the progress and its receiver,
    and the user's cancel."""

    blobs: Path
    progress: Progress
    report: ProgressCallback
    cancel: threading.Event | None


class Downloader:
    """Downloads one GGUF (or a split set) into the hub cache with progress and cancel."""

    def __init__(self, cache: HubCache, token: str | None = None) -> None:
        self.cache = cache
        self.token = token

    def _meta(self, repo: str, filename: str, revision: str) -> _FileMeta:
        # Everything the hub sends becomes a path in the cache: it is checked first, as
        # huggingface_hub's own downloader does, so a hostile hub writes nowhere else.
        _check_name(repo, filename)
        url = hf_hub_url(repo, filename, revision=revision, endpoint=hub_endpoint())
        try:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=hub_endpoint())
        except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
            raise _hub_error(exc, f"{repo}/{filename}") from None
        if meta.size is None or meta.etag is None or meta.commit_hash is None:
            raise HubError(f"{repo}/{filename}: the hub did not say the file's size and checksum")
        if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", meta.etag):
            raise HubError(f"{repo}: the hub sent an ETag that is not a checksum ({meta.etag!r})")
        if not re.fullmatch(r"[0-9a-f]{40}", meta.commit_hash):
            raise HubError(
                f"{repo}: the hub sent a commit that is not a hash ({meta.commit_hash!r})"
            )
        sha = meta.etag if re.fullmatch(r"[0-9a-f]{64}", meta.etag) else None
        return _FileMeta(
            filename, meta.location or url, meta.size, sha, meta.etag, meta.commit_hash
        )

    def check(self, repo: str, filename: str, revision: str = "main") -> None:
        """Raises :class:`HubError` unless the hub answers for this file now."""
        if offline():
            raise HubError(f"{repo}/{filename}: {OFFLINE_MESSAGE}")
        self._meta(repo, filename, revision)

    def pull(
        self,
        repo: str,
        filename: str,
        revision: str = "main",
        on_progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> Path:
        """Download (or resume) ``filename`` and its split siblings; returns the first file."""
        metas = [self._meta(repo, name, revision) for name in split_parts(filename)]
        progress = Progress(f"{repo}/{filename}", bytes_total=sum(m.size for m in metas))
        callback = on_progress or (lambda _p: None)

        def report(state: Progress) -> None:
            callback(replace(state))  # each event is a snapshot: receivers may keep it

        repo_dir = self.cache.repo_dir(repo)
        blobs = repo_dir / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        pending = [m for m in metas if not (blobs / m.etag).exists()]
        on_disk = self._bytes_on_disk(filename, metas, pending, blobs)
        progress.bytes_done = progress.bytes_at_start = on_disk
        progress.state = "downloading"
        progress.started_at = time.monotonic()
        report(progress)
        run = _PullRun(blobs, progress, report, cancel)
        try:
            for meta in pending:
                self._fetch(repo, meta, run)
            for meta in metas:
                self._link(repo_dir, meta, revision)
        except DownloadCancelled:
            progress.state = "cancelled"
            report(progress)
            raise
        except LocalchatError as exc:
            progress.state, progress.error = "failed", str(exc)
            report(progress)
            raise
        progress.state = "done"
        report(progress)
        first = self.cache.snapshot_path(repo, filename, revision)
        assert first is not None
        with contextlib.suppress(ModelFileError):
            read_gguf(first)
        return first

    def _bytes_on_disk(
        self, filename: str, metas: list[_FileMeta], pending: list[_FileMeta], blobs: Path
    ) -> int:
        """What the cache holds of the set already, whole files and partial ones; raises
        when the rest would not fit on the disk (with a margin)."""
        done_bytes = sum(m.size for m in metas if m not in pending)
        partial_bytes = sum(file_size(blobs / f"{m.etag}.incomplete") for m in pending)
        needed = sum(m.size for m in pending) - partial_bytes
        free = shutil.disk_usage(blobs).free
        if needed + DISK_MARGIN_BYTES > free:
            raise WorldError(
                f"not enough disk space for {filename}: it needs {format_bytes(needed)} more,"
                f" {format_bytes(free)} is free in {self.cache.root}"
            )
        return done_bytes + partial_bytes

    def _fetch(self, repo: str, meta: _FileMeta, run: _PullRun) -> None:
        """One file of the set downloaded (or resumed) and verified, under huggingface_hub's
        own per-file lock: two processes never write one file."""
        lock = self.cache.locks_dir(repo)
        lock.mkdir(parents=True, exist_ok=True)
        with FileLock(lock / f"{meta.etag}.lock"):
            if (run.blobs / meta.etag).exists():
                return  # the other process finished it meanwhile
            run.progress.state = "downloading"
            self.cache.note_partial(repo, meta.etag, meta.filename)
            self._transfer(meta, run)
            run.progress.state = "verifying"
            run.report(run.progress)
            self._verify(meta, run.blobs)
            self.cache.forget_partial(repo, meta.etag)

    def _transfer(self, meta: _FileMeta, run: _PullRun) -> None:
        partial = run.blobs / f"{meta.etag}.incomplete"
        headers = build_hf_headers(token=self.token)
        for attempt in range(RETRIES + 1):
            have = file_size(partial)
            if have >= meta.size:
                return
            request_headers = {**headers, "Range": f"bytes={have}-"}
            try:
                with (
                    get_session().stream(
                        "GET",
                        meta.url,
                        headers=request_headers,
                        follow_redirects=True,
                        timeout=30.0,
                    ) as response,
                    partial.open("ab") as out,
                ):
                    if response.status_code == 200 and have:
                        out.truncate(0)  # the server ignored the range: start over
                        run.progress.bytes_done -= have
                    elif response.status_code not in (200, 206):
                        response.read()
                        raise HubError(
                            f"{meta.filename}: the hub answered HTTP {response.status_code}"
                        )
                    for chunk in response.iter_bytes(CHUNK_BYTES):
                        out.write(chunk)
                        run.progress.bytes_done += len(chunk)
                        run.report(run.progress)
                        if run.cancel is not None and run.cancel.is_set():
                            raise DownloadCancelled(
                                f"download of {meta.filename} stopped; run the pull again to resume"
                                f" ({format_bytes(file_size(partial) + 0)} kept)"
                            )
            except (httpx.TransportError, OSError) as exc:
                if attempt == RETRIES:
                    raise _hub_error(exc, meta.filename) from None
                time.sleep(
                    0.2 * (attempt + 1)
                )  # the connection dropped: resume from the partial file
        if file_size(partial) < meta.size:
            raise HubError(
                f"{meta.filename}: the transfer kept ending early; run the pull again to resume"
            )

    def _verify(self, meta: _FileMeta, blobs: Path) -> None:
        partial = blobs / f"{meta.etag}.incomplete"
        size = file_size(partial)
        problem = None
        if size != meta.size:
            problem = f"size {size} bytes, the hub says {meta.size}"
        elif meta.sha256 is not None and file_sha256(partial) != meta.sha256:
            problem = "sha256 does not match the hub's"
        if problem is None:
            try:
                read_gguf(partial)
            except ModelFileError as exc:
                problem = f"not a valid GGUF file ({exc})"
        if problem is not None:
            partial.unlink(missing_ok=True)
            raise ModelFileError(
                f"{meta.filename} arrived damaged ({problem}); it was deleted, not loaded —"
                " run the pull again"
            )
        partial.replace(blobs / meta.etag)

    def _link(self, repo_dir: Path, meta: _FileMeta, revision: str) -> None:
        link = repo_dir / "snapshots" / meta.commit / meta.filename
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and not link.exists():  # dangling (a cache moved or copied)
            link.unlink()
        if not link.exists():
            target = os.path.relpath(repo_dir / "blobs" / meta.etag, link.parent)
            with contextlib.suppress(FileExistsError):
                link.symlink_to(target)
        refs = repo_dir / "refs"
        refs.mkdir(exist_ok=True)
        if not re.fullmatch(r"[0-9a-f]{40}", revision):
            (refs / revision).write_text(meta.commit)


def _check_name(repo: str, filename: str) -> None:
    """A file name from the hub must stay inside the repo's snapshot folder."""
    parts = filename.split("/")
    if (
        not filename
        or filename.startswith("/")
        or "\\" in filename
        or "\0" in filename
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise HubError(f"{repo}: the hub listed a file name that leaves the cache ({filename!r})")


def file_size(path: Path) -> int:
    """A file's size, 0 when it is not there."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def file_sha256(path: Path) -> str:
    """A file's sha256, read in chunks (the hub's LFS id of a model file)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES * 4), b""):
            digest.update(chunk)
    return digest.hexdigest()


def choose_file(files: list[RemoteFile], quant: str | None, preferred: list[str]) -> RemoteFile:
    """The file for ``quant``, or the first of ``preferred`` (the planner's order) present."""
    if not files:
        raise UsageError("the repository has no GGUF files")
    if quant is not None:
        for remote in files:
            if remote.quant == quant:
                return remote
        available = sorted({f.quant for f in files}, key=lambda q: (quality_rank(q), q))
        raise UsageError(f"no {quant} file in {files[0].repo}; it has {', '.join(available)}")
    for wanted in preferred:
        for remote in files:
            if remote.quant == wanted:
                return remote
    return min(files, key=lambda f: f.size)
