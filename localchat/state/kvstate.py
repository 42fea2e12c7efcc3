"""Saved KV cache states: one file per (conversation, model), validated before every restore.

File layout (little-endian), after llama.cpp server's slot files::

    magic    8 bytes  b"LCKVSTAT"
    version  u32
    hlen     u32      length of the JSON header
    header   hlen     model fingerprint, n_ctx, KV type, llama.cpp version, token count,
                      payload length, CRC-32 of tokens + payload
    tokens   4 × n    the token ids the state holds, int32
    payload  ...      llama_state_seq_get_data bytes (the KV cells, no logits)

A state that fails any check is rejected with the reason, and the caller re-evaluates from
the transcript: a bad file costs time, never a wrong continuation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from localchat.atomic import write_atomic
from localchat.paths import EMBEDDINGS_FOLDER, ensure_private_dir

MAGIC = b"LCKVSTAT"
FORMAT_VERSION = 2
DEFAULT_BUDGET_BYTES = 2 * 1024**3
SUFFIX = ".lckv"
COPY_CHUNK_BYTES = 8 * 1024 * 1024
_PREFIX = struct.Struct("<8sII")
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class StateKey:
    """What a state depends on: restoring it under any other key would be wrong."""

    model_fingerprint: str
    n_ctx: int
    kv_type: str
    llama_cpp: str


@dataclass
class SavedState:
    key: StateKey
    tokens: list[int]
    payload: bytes | memoryview


class StateRejected(Exception):
    """A state file that cannot be used; ``str()`` says why in a few words."""


def tokens_state_id(prefix: str, tokens: Sequence[int]) -> str:
    """The name of a state that holds exactly ``tokens``: ``prefix`` (whose states these
    are) and a hash of the ids (the file holds the ids too, so a hit is compared, not
    trusted)."""
    return prefix + hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:32]


def _checksum(tokens_bytes: bytes | memoryview, payload: bytes | memoryview) -> str:
    """CRC-32 of tokens + payload: catches torn and corrupted files at ~4 GB/s (SHA-256 would
    double a restore's cost; nothing here defends against a deliberate forger)."""
    return f"{zlib.crc32(payload, zlib.crc32(tokens_bytes)):08x}"


def encode_state(state: SavedState) -> list[bytes | memoryview]:
    tokens_bytes = array("i", state.tokens).tobytes()
    header = json.dumps(
        {
            **asdict(state.key),
            "n_tokens": len(state.tokens),
            "payload_bytes": len(state.payload),
            "crc32": _checksum(tokens_bytes, state.payload),
            "saved_at": time.time(),
        }
    ).encode()
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header, tokens_bytes, state.payload]


def read_state(path: Path, expected: StateKey) -> SavedState:
    """Read and validate a state file; raises StateRejected naming the first problem.

    The payload is handed on as a view of a mapping of the file: the KV bytes are copied
    once, by llama.cpp, from the page cache into the cache.
    """
    data = _mapped(path)
    header = _read_header(data)
    _check_key(header.key, expected)
    start = _PREFIX.size + header.length
    tokens_end = start + 4 * header.n_tokens
    if (
        header.n_tokens < 0
        or header.payload_bytes < 0
        or tokens_end + header.payload_bytes != len(data)
    ):
        raise StateRejected("truncated file")
    view = memoryview(data)
    tokens_bytes = view[start:tokens_end]
    payload = view[tokens_end:]
    if _checksum(tokens_bytes, payload) != header.checksum:
        raise StateRejected("checksum mismatch (corrupt file)")
    tokens = array("i")
    tokens.frombytes(tokens_bytes)
    return SavedState(header.key, tokens.tolist(), payload)


def _mapped(path: Path) -> mmap.mmap:
    """The whole state file, mapped; a missing, unreadable or too short file is rejected."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < _PREFIX.size:
                raise StateRejected("truncated file")
            # A read-only mapping of the page cache, its pages mapped at once: no copy. (A
            # private writable one is copied whole when pre-faulted: 26 MB of fresh memory,
            # 10 ms here and 60-90 ms when the virtual machine's host is slow to give it.)
            # State files are replaced by rename, never rewritten: the mapped bytes stay.
            data = _map(handle.fileno(), size)
    except FileNotFoundError:
        raise StateRejected("no saved state") from None
    except OSError as exc:
        raise StateRejected(f"unreadable ({exc.strerror})") from None
    if len(data) < _PREFIX.size:
        raise StateRejected("truncated file")
    return data


@dataclass(frozen=True)
class _Header:
    """A state file's header: its key, what follows it, and that part's checksum."""

    length: int  # of the JSON header, in bytes
    key: StateKey
    n_tokens: int
    payload_bytes: int
    checksum: str


def _key_of(header: Any) -> StateKey:
    """The key a header names (a missing or mistyped field raises KeyError or ValueError)."""
    return StateKey(
        str(header["model_fingerprint"]),
        int(header["n_ctx"]),
        str(header["kv_type"]),
        str(header["llama_cpp"]),
    )


def _read_header(data: mmap.mmap) -> _Header:
    """The prefix checked (magic, version, length) and the JSON header parsed."""
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise StateRejected("not a localchat state file")
    if version != FORMAT_VERSION:
        raise StateRejected(f"state format {version}, this localchat reads {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(data):
        raise StateRejected("truncated file")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
        return _Header(
            header_len,
            _key_of(header),
            int(header["n_tokens"]),
            int(header["payload_bytes"]),
            str(header["crc32"]),
        )
    except (ValueError, KeyError, TypeError):
        raise StateRejected("corrupt header") from None


def _check_key(key: StateKey, expected: StateKey) -> None:
    """A state saved under another key is rejected, saying which part differs."""
    if key.model_fingerprint != expected.model_fingerprint:
        raise StateRejected("saved for another model file")
    if key.n_ctx != expected.n_ctx:
        raise StateRejected(f"saved with context {key.n_ctx}, now {expected.n_ctx}")
    if key.kv_type != expected.kv_type:
        raise StateRejected(f"saved with KV type {key.kv_type}, now {expected.kv_type}")
    if key.llama_cpp != expected.llama_cpp:
        raise StateRejected(f"saved by llama.cpp {key.llama_cpp}, now {expected.llama_cpp}")


def _map(descriptor: int, size: int) -> mmap.mmap:
    """The file mapped read-only; privately where a file system refuses to share its pages
    (FUSE in direct I/O mode)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    try:
        return mmap.mmap(descriptor, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
    except OSError:
        return mmap.mmap(descriptor, size, flags=mmap.MAP_PRIVATE | populate, prot=mmap.PROT_READ)


def read_state_tokens(path: Path, expected: StateKey) -> list[int]:
    """The token ids a state file holds, read without its payload (an index of many files
    is built from these; the payload is checked when the state is restored). Raises
    StateRejected for a file of another key or a damaged header."""
    try:
        with path.open("rb") as handle:
            magic, version, header_len = _PREFIX.unpack(handle.read(_PREFIX.size))
            if magic != MAGIC or version != FORMAT_VERSION or header_len > MAX_HEADER_BYTES:
                raise StateRejected("not a state file this localchat reads")
            header = json.loads(handle.read(header_len))
            key = _key_of(header)
            if key != expected:
                raise StateRejected("saved under another model, context or build")
            n_tokens = int(header["n_tokens"])
            if not 0 <= n_tokens <= key.n_ctx:
                raise StateRejected("corrupt header")
            tokens = array("i")
            tokens.frombytes(handle.read(4 * n_tokens))
    except (OSError, struct.error, ValueError, KeyError, TypeError, MemoryError):
        raise StateRejected("unreadable or truncated") from None
    if len(tokens) != n_tokens:
        raise StateRejected("truncated file")
    return tokens.tolist()


class StateStore:
    """The states folder: where each state lives, atomic saves, and an LRU disk budget."""

    def __init__(self, directory: Path, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.directory = directory
        self.budget_bytes = budget_bytes

    def path_for(self, conversation_id: str, model_fingerprint: str) -> Path:
        return self.directory / f"{conversation_id}.{model_fingerprint[:16]}{SUFFIX}"

    def save(self, conversation_id: str, state: SavedState) -> Path:
        """Write atomically (the old state stays valid until the rename), then enforce the budget."""
        ensure_private_dir(self.directory)
        path = self.path_for(conversation_id, state.key.model_fingerprint)
        write_atomic(path, encode_state(state))
        self.evict(keep=path)
        return path

    def load(self, conversation_id: str, expected: StateKey) -> SavedState:
        """The validated state for this conversation and key; marks it recently used."""
        path = self.path_for(conversation_id, expected.model_fingerprint)
        state = read_state(path, expected)
        with contextlib.suppress(OSError):
            os.utime(path)
        return state

    def discard(self, conversation_id: str, model_fingerprint: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path_for(conversation_id, model_fingerprint).unlink()

    def copy(self, source_id: str, target_id: str, model_fingerprint: str) -> bool:
        """Copy a conversation's saved state of one model to another conversation (a fork
        starts from its source's cache); False if there is none."""
        source = self.path_for(source_id, model_fingerprint)
        target = self.path_for(target_id, model_fingerprint)
        try:
            with source.open("rb") as handle:
                write_atomic(target, iter(lambda: handle.read(COPY_CHUNK_BYTES), b""))
        except FileNotFoundError:
            return False
        self.evict(keep=target)
        return True

    def discard_unlisted(self, conversation_id: str, keep_fingerprints: Iterable[str]) -> None:
        """Delete a conversation's states of every model but ``keep_fingerprints``."""
        keep = {self.path_for(conversation_id, fingerprint) for fingerprint in keep_fingerprints}
        for path in self.directory.glob(f"{conversation_id}.*{SUFFIX}"):
            if path not in keep:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def delete_conversation(self, conversation_id: str) -> None:
        for path in self.directory.glob(f"{conversation_id}.*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def files(self) -> list[Path]:
        if not self.directory.exists():
            return []
        return list(self.directory.glob(f"*{SUFFIX}"))

    def budgeted(self) -> list[Path]:
        """The files the budget counts: the states, and the encoded images kept beside them
        (``paths.image_embeddings_dir``: a state that holds an image is rebuilt from them)."""
        embeddings = self.directory / EMBEDDINGS_FOLDER
        return self.files() + list(embeddings.glob("*/*.emb"))

    def total_bytes(self) -> int:
        return sum(_size(p) for p in self.budgeted())

    def _remove_stale_temp_files(self) -> list[Path]:
        """Temp files a killed process left mid-save (a live save is never an hour old)."""
        removed = []
        cutoff = time.time() - STALE_TEMP_S
        for path in self.directory.glob(f".*{SUFFIX}.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed.append(path)
        return removed

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Delete least-recently-used states (and encoded images) until the folder fits
        the budget."""
        entries = []
        for path in self.budgeted():
            with contextlib.suppress(FileNotFoundError):
                stat = path.stat()
                entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        removed = self._remove_stale_temp_files()
        for _mtime, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.budget_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
            total -= size
        return removed


STALE_TEMP_S = 3600


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class BackgroundSaver:
    """Writes states on a worker thread, so saving never delays the next prompt.

    Saves run in order; ``wait()`` blocks until all queued saves are on disk (used before a
    process exits). A failed save (disk full…) is reported to ``on_error`` and skipped.
    """

    def __init__(self, states: StateStore, on_error: Callable[[str], None] | None = None) -> None:
        self.states = states
        self.on_error = on_error
        self._queue: queue.Queue[tuple[str, SavedState, Callable[[], None] | None] | None] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._run, name="kv-state-saver", daemon=True)
        self._thread.start()
        self.last_error: str | None = None

    def save(
        self, conversation_id: str, state: SavedState, then: Callable[[], None] | None = None
    ) -> None:
        """Queue a save; ``then`` runs on the saver's thread after it (written or failed)."""
        self._queue.put((conversation_id, state, then))

    @property
    def pending(self) -> int:
        """Saves queued or being written."""
        return self._queue.unfinished_tasks

    def wait(self, timeout: float | None = 60.0) -> bool:
        """Block until the queued saves are on disk; False if ``timeout`` passed first."""
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def close(self) -> None:
        self.wait()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                conversation_id, state, then = item
                try:
                    self.states.save(conversation_id, state)
                except Exception as exc:  # the saver must outlive any failure: report, go on
                    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    self.last_error = f"KV state not saved ({reason}); the transcript is safe"
                    if self.on_error is not None:
                        self.on_error(self.last_error)
                finally:
                    if then is not None:
                        then()
            finally:
                self._queue.task_done()
