"""One writer per conversation: an advisory file lock with a clear "in use" message."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from localchat.errors import LocalchatError
from localchat.paths import ensure_private_dir

POLL_S = 0.1


class ConversationInUse(LocalchatError):
    """Another process holds the conversation."""


class ConversationLock:
    """Held while a process may write to a conversation; released on close or process exit."""

    def __init__(
        self, directory: Path, conversation_id: str, name: str, wait_s: float = 0.0
    ) -> None:
        """``wait_s``: how long to wait for another process to let go before giving up."""
        ensure_private_dir(directory)
        self.path = directory / f"{conversation_id}.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    continue
                holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(self._fd)
                waited = f" (waited {wait_s:g} s)" if wait_s else ""
                raise ConversationInUse(
                    f"conversation {name!r} is in use by another localchat process (pid"
                    f" {holder}){waited}; close it, wait for its reply, or use --wait SECONDS"
                ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self, remove: bool = False) -> None:
        """Let go of the lock; ``remove`` deletes the lock file (the conversation is gone)."""
        if self._fd >= 0:
            if remove:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Wait for and hold an exclusive lock on ``path`` (created readable by the user only):
    one process at a time creates or upgrades what it guards."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
