"""The server's prompt cache on disk: the state after each reply, found again by its prefix.

Every client resends its whole conversation with each request. After a reply the sequence's
KV state (the prompt and the reply) is saved in the background, like a conversation's, in
the same states folder and disk budget (least recently used go first). States are found by
the idea of vLLM's automatic prefix caching: the token ids are cut into blocks of
``BLOCK`` and each block is named by a hash chained over every block before it, so a hash
names a whole prefix; an index maps those hashes to the states that hold them. A request
takes the state of its longest matching block, and only where the state's token ids equal
its own — conversations never mix. The index is rebuilt at start from the files' token
lists (their payloads are checked when restored), so a restarted server finds them all, and
the newest go back into its sequences before it serves (``newest``): the conversations it
answered last continue from memory, as if it had never stopped.

A conversation's next request extends the state its previous one left: the older state,
wholly a prefix of the new one, is dropped, so the shared part is stored once.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from localchat.chat.prompt import common_prefix
from localchat.state.kvstate import (
    SUFFIX,
    BackgroundSaver,
    SavedState,
    StateKey,
    StateRejected,
    StateStore,
    read_state_tokens,
    tokens_state_id,
)

BLOCK = 64  # tokens a hash names; a shorter match is not worth a file read
MAX_PENDING = 4  # saves waiting for the disk; beyond it a new one is skipped
ID_PREFIX = "serve-"


def block_hashes(tokens: Sequence[int]) -> list[str]:
    """The chained hash of each whole block of ``tokens``: the i-th names tokens[:(i+1)*BLOCK]."""
    hashes: list[str] = []
    running = hashlib.sha256()
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        running.update(array("i", tokens[end - BLOCK : end]).tobytes())
        hashes.append(running.copy().hexdigest()[:32])
    return hashes


def state_id(tokens: Sequence[int]) -> str:
    """The name of the saved state that holds exactly ``tokens``."""
    return tokens_state_id(ID_PREFIX, tokens)


@dataclass(frozen=True)
class CacheHit:
    """A saved state and how many of the request's tokens it holds."""

    state: SavedState
    shared: int
    state_id: str


class PromptCache:
    """The index of the server's saved states for one model, and their saves.

    A state joins the index when its save is queued and is served from memory until it is
    on disk (``_pending``); the state it replaces leaves the disk once the new one is there.
    Saves are best effort: while ``MAX_PENDING`` wait for the disk, a new one is skipped
    (the cache in memory still serves the next request)."""

    def __init__(self, states: StateStore, key: StateKey, saver: BackgroundSaver) -> None:
        self.states = states
        self.key = key
        self.saver = saver
        self._lock = threading.Lock()
        self._by_block: dict[str, str] = {}  # chained block hash -> state id
        self._blocks: dict[str, list[str]] = {}  # state id -> its block hashes
        self._pending: dict[str, SavedState] = {}  # queued, not yet on disk
        self._found: list[str] = []  # the states on disk at start, newest first
        self._scan()

    def _scan(self) -> None:
        """Index the states earlier runs saved for this model (the newest wins a block)."""
        pattern = f"{ID_PREFIX}*.{self.key.model_fingerprint[:16]}{SUFFIX}"
        found = []
        for path in self.states.directory.glob(pattern):
            try:
                found.append((path.stat().st_mtime, path, read_state_tokens(path, self.key)))
            except (StateRejected, OSError):  # damaged, another key, or evicted meanwhile
                continue
        found.sort(key=lambda f: f[0])
        for _mtime, path, tokens in found:
            sid = path.name.split(".", 1)[0]
            self._add(sid, tokens)
            self._found.insert(0, sid)

    def newest(self, count: int) -> list[tuple[str, SavedState]]:
        """Up to ``count`` of the states found on disk at start, the most recently used
        first, read and validated (a damaged or evicted one is forgotten and skipped)."""
        taken: list[tuple[str, SavedState]] = []
        for sid in self._found:
            if len(taken) == count:
                break
            try:
                taken.append((sid, self.states.load(sid, self.key)))
            except StateRejected:
                self._forget(sid)
        return taken

    def _add(self, sid: str, tokens: Sequence[int]) -> None:
        blocks = block_hashes(tokens)
        with self._lock:
            for block in blocks:
                self._by_block[block] = sid
            self._blocks[sid] = blocks

    def _forget(self, sid: str) -> None:
        with self._lock:
            for block in self._blocks.pop(sid, []):
                if self._by_block.get(block) == sid:
                    del self._by_block[block]

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, prompt: Sequence[int], beyond: int = 0) -> CacheHit | None:
        """The saved state sharing the longest prefix with ``prompt``, validated, where it
        holds at least a block more than ``beyond`` tokens (what the caller already has);
        None when there is none."""
        hashes = block_hashes(prompt)
        for index in range(len(hashes) - 1, -1, -1):
            if (index + 1) * BLOCK < beyond + BLOCK:
                break  # shorter than what the caller holds: not worth a read
            with self._lock:
                sid = self._by_block.get(hashes[index])
                state = self._pending.get(sid) if sid is not None else None
            if sid is None:
                continue
            if state is None:
                try:
                    state = self.states.load(sid, self.key)
                except StateRejected:  # evicted by the budget, or damaged: forget it
                    self._forget(sid)
                    continue
            shared = common_prefix(state.tokens, prompt)
            if shared >= (index + 1) * BLOCK:  # the hash is the ids: never another's state
                return CacheHit(state, shared, sid)
            self._forget(sid)
        return None

    def save(
        self, tokens: Sequence[int], payload: bytes, replaces: str | None = None
    ) -> str | None:
        """Save the state holding ``tokens`` in the background (None: skipped, the disk is
        behind); ``replaces``: a state whose tokens are a prefix of these, dropped once the
        new one is on disk."""
        sid = state_id(tokens)
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                return None
        state = SavedState(self.key, list(tokens), payload)
        with self._lock:
            self._pending[sid] = state
        self._add(sid, tokens)
        if replaces == sid:
            replaces = None
        if replaces is not None:
            self._forget(replaces)

        fingerprint = self.key.model_fingerprint

        def on_disk() -> None:  # saves run in order: the replaced one was written first
            with self._lock:
                self._pending.pop(sid, None)
            written = self.states.path_for(sid, fingerprint).exists()  # not when it failed
            if replaces is not None and written:
                self.states.discard(replaces, fingerprint)

        self.saver.save(sid, state, on_disk)
        return sid
