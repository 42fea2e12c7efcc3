"""The images messages hold: private files named by the SHA-256 of their bytes.

An image is stored once however many messages (or conversations, or forks) show it: its
key is the hash of its bytes, its file ``<key[:2]>/<key>``, readable by the user only, with
what it holds beside it (``<key>.json``: type and size, read without decoding it).

Each image also gets a number, its id, kept in ``ids.sqlite`` beside the files: the engine
writes an image's positions in a token list with ids made from it, and token lists are
kept, so an id is the same image's forever in a data folder and never another's. The
row stays when the image is deleted: the same bytes stored again get their id back, and a
new image always gets a new one (AUTOINCREMENT never hands out a number twice).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING

from localchat.atomic import write_atomic
from localchat.errors import LocalchatError
from localchat.paths import ensure_private_dir

if TYPE_CHECKING:
    from localchat.chat.image_files import ImageFacts
    from localchat.state.store import Store

_KEY = re.compile(r"[0-9a-f]{64}")
# Ids stay under 2**30: an image's cells are -2·id and -(2·id + 1) in 32-bit token lists.
FIRST_ID_SPAN = 1 << 28
_VARIANT = re.compile(r"[0-9a-f]{0,64}")
IDS_FILE = "ids.sqlite"
# An image stored (or stored again) this recently is never swept: another process may be
# about to write the message that shows it.
KEEP_RECENT_S = 600.0


class ImageMissing(LocalchatError):
    """A message names an image whose file is not in the store (deleted, or a data folder
    copied without its images)."""


@dataclass(frozen=True)
class StoredImage:
    """An image in the store: its key, its file, and what that file holds."""

    key: str
    path: Path
    mime: str
    width: int
    height: int
    size_bytes: int


def image_key(data: bytes) -> str:
    """The key of an image's stored bytes: their SHA-256, in hex."""
    return sha256(data).hexdigest()


class ImageStore:
    """Images under ``directory`` (created private on first write); safe to share between
    threads, and between processes on one data folder."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def path(self, key: str) -> Path:
        """Where the image ``key`` is (or would be) kept."""
        _check_key(key)
        return self.directory / key[:2] / key

    def put(self, facts: ImageFacts) -> StoredImage:
        """Store checked bytes (``chat.image_files.inspect_image``); the same bytes again
        write nothing (the file is only touched, so a sweep keeps it)."""
        key = image_key(facts.data)
        path = self.path(key)
        stored = StoredImage(key, path, facts.mime, facts.width, facts.height, len(facts.data))
        ensure_private_dir(self.directory)  # first: only the folder made last gets 0700
        with self._files():  # a sweep never deletes it between this check and the touch
            ensure_private_dir(path.parent)
            try:
                if not _sidecar(path).exists():
                    raise FileNotFoundError(path)
                os.utime(path)
            except FileNotFoundError:
                write_atomic(path, facts.data)
                meta = {"mime": stored.mime, "width": stored.width, "height": stored.height}
                write_atomic(_sidecar(path), json.dumps(meta).encode())
        self.image_id(key)  # ids follow the order images were first stored
        return stored

    def get(self, key: str) -> bytes:
        """The image's bytes."""
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise ImageMissing(_missing(key, self.directory)) from None

    def facts(self, key: str) -> StoredImage:
        """What the image holds, from the note beside it (nothing is decoded)."""
        path = self.path(key)
        try:
            size = path.stat().st_size
            meta = json.loads(_sidecar(path).read_text())
        except FileNotFoundError:
            raise ImageMissing(_missing(key, self.directory)) from None
        return StoredImage(key, path, meta["mime"], meta["width"], meta["height"], size)

    def find(self, key: str) -> StoredImage | None:
        """The image's facts, or None where it is not stored."""
        try:
            return self.facts(key)
        except ImageMissing:
            return None

    def delete(self, key: str) -> bool:
        """Remove the image's file (its id stays its own); whether there was one."""
        path = self.path(key)
        with contextlib.suppress(FileNotFoundError):
            _sidecar(path).unlink()
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def delete_if_unsent(self, key: str, since: float) -> bool:
        """Delete the image where it was last stored before ``since`` (a time), checked and
        deleted under the store's file lock, so that another thread or process storing it
        again meanwhile keeps it; whether it was deleted."""
        with self._files():
            stored_at = self.stored_at(key)
            return stored_at is not None and stored_at < since and self.delete(key)

    @contextlib.contextmanager
    def _files(self) -> Iterator[None]:
        """The store's files to this thread alone, and to this process (``.lock`` beside
        them, an advisory lock): a put's check and a sweep's check-and-delete never
        interleave."""
        ensure_private_dir(self.directory)
        with self._file_lock:
            descriptor = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
                yield
            finally:
                os.close(descriptor)  # and the lock with it

    def keys(self) -> list[str]:
        """Every stored image's key, sorted."""
        if not self.directory.is_dir():
            return []
        return sorted(
            p.name
            for p in self.directory.glob("??/*")
            if _KEY.fullmatch(p.name) and p.parent.name == p.name[:2]
        )

    def stored_at(self, key: str) -> float | None:
        """When the image was last stored (its file's mtime), or None if it is not."""
        try:
            return self.path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    # -- ids -----------------------------------------------------------------------------
    def image_id(self, key: str, variant: str = "") -> int:
        """The image's id: given on first asking, the same ever after, never another's.
        ``variant`` names one way of reading it (a projector's fingerprint): each gets an id
        of its own, so what one projector made of an image never stands for another's."""
        _check_key(key)
        if not _VARIANT.fullmatch(variant):
            raise ValueError(f"not an image id variant: {variant[:80]!r}")
        name = f"{key}@{variant}" if variant else key
        with self._ids() as db:
            db.execute("INSERT OR IGNORE INTO image_ids (key) VALUES (?)", (name,))
            row = db.execute("SELECT id FROM image_ids WHERE key = ?", (name,)).fetchone()
        return int(row[0])

    def name_of_id(self, image_id: int) -> tuple[str, str]:
        """The key of the image the id was given to, and the variant it was asked with."""
        with self._ids() as db:
            row = db.execute("SELECT key FROM image_ids WHERE id = ?", (image_id,)).fetchone()
        if row is None:
            raise ImageMissing(f"no image has id {image_id} in {self.directory}")
        key, _, variant = str(row[0]).partition("@")
        return key, variant

    @contextlib.contextmanager
    def _ids(self) -> Iterator[sqlite3.Connection]:
        """The id table, in one write transaction (another process waits its turn)."""
        with self._lock:
            db = self._db or self._open_ids()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _open_ids(self) -> sqlite3.Connection:
        path = ensure_private_dir(self.directory) / IDS_FILE
        # Created readable by the user only before SQLite opens it.
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        db.execute("BEGIN IMMEDIATE")
        db.execute(
            "CREATE TABLE IF NOT EXISTS image_ids"
            " (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL UNIQUE)"
        )
        # The ids start at a random point: states and prompt caches hold them, and an id
        # table lost while those stayed must not give a known id to another image.
        if not db.execute("SELECT 1 FROM sqlite_sequence WHERE name = 'image_ids'").fetchone():
            start = secrets.randbelow(FIRST_ID_SPAN)
            db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('image_ids', ?)", (start,))
        db.execute("COMMIT")
        self._db = db
        return db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def delete_unreferenced(
    store: Store,
    images: ImageStore,
    keys: Iterable[str] | None = None,
    keep_recent_s: float = KEEP_RECENT_S,
) -> list[str]:
    """Delete the images of ``keys`` (None: every stored one) that no message of any
    conversation shows, except those stored in the last ``keep_recent_s`` seconds (a
    message about to show one may not be written yet). The keys deleted."""
    candidates = images.keys() if keys is None else list(dict.fromkeys(keys))
    referenced = store.image_references()
    since = time.time() - keep_recent_s
    return [k for k in candidates if k not in referenced and images.delete_if_unsent(k, since)]


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _check_key(key: str) -> None:
    if not _KEY.fullmatch(key):
        raise ValueError(f"not an image key (64 hex digits): {key[:80]!r}")


def _missing(key: str, directory: Path) -> str:
    return (
        f"image {key[:12]} is not in {directory} (deleted, or the data folder was copied"
        " without its images); put the file back there, or branch the conversation before"
        " the message that shows it"
    )
