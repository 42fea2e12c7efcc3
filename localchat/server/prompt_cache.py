"""The server's prompt cache on disk: the state after each reply, found again by its prefix.

Every client resends its whole conversation with each request. After a reply the sequence's
KV state (the prompt and the reply) is saved in the background, like a conversation's, in
the same states folder and disk budget (least recently used go first). States are found by
the idea of vLLM's automatic prefix caching: the token ids are cut into blocks of
``BLOCK`` and each block is named by a hash chained over every block before it, so a hash
names a whole prefix; an index maps those hashes to the states that hold them. A request
takes the state of its longest matching block, and only where the state's token ids equal
its own — conversations never mix. The index is rebuilt at start from the files' token
lists (their payloads are checked when restored), so a restarted server finds them all.

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
)

BLOCK = 64  # tokens a hash names; a shorter match is not worth a file read
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
    return ID_PREFIX + hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class CacheHit:
    """A saved state and how many of the request's tokens it holds."""

    state: SavedState
    shared: int
    state_id: str


class PromptCache:
    """The index of the server's saved states for one model, and their saves."""

    def __init__(self, states: StateStore, key: StateKey, saver: BackgroundSaver) -> None:
        self.states = states
        self.key = key
        self.saver = saver
        self._lock = threading.Lock()
        self._by_block: dict[str, str] = {}  # chained block hash -> state id
        self._lengths: dict[str, int] = {}  # state id -> tokens it holds
        self._scan()

    def _scan(self) -> None:
        """Index the states earlier runs saved for this model (the newest wins a block)."""
        pattern = f"{ID_PREFIX}*.{self.key.model_fingerprint[:16]}{SUFFIX}"
        files = sorted(self.states.directory.glob(pattern), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                tokens = read_state_tokens(path, self.key)
            except (StateRejected, FileNotFoundError):
                continue
            self._add(path.name.split(".", 1)[0], tokens)

    def _add(self, sid: str, tokens: Sequence[int]) -> None:
        with self._lock:
            for block in block_hashes(tokens):
                self._by_block[block] = sid
            self._lengths[sid] = len(tokens)

    def _forget(self, sid: str) -> None:
        with self._lock:
            self._lengths.pop(sid, None)
            for block in [b for b, s in self._by_block.items() if s == sid]:
                del self._by_block[block]

    def __len__(self) -> int:
        return len(self._lengths)

    def lookup(self, prompt: Sequence[int]) -> CacheHit | None:
        """The saved state sharing the longest prefix with ``prompt`` (whole blocks at
        least), validated; None when there is none."""
        hashes = block_hashes(prompt)
        for index in range(len(hashes) - 1, -1, -1):
            with self._lock:
                sid = self._by_block.get(hashes[index])
            if sid is None:
                continue
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

    def save(self, tokens: Sequence[int], payload: bytes, replaces: str | None = None) -> str:
        """Save the state holding ``tokens`` in the background; ``replaces``: a state whose
        tokens are a prefix of these, dropped once the new one is on disk."""
        sid = state_id(tokens)
        if replaces == sid:
            replaces = None
        if replaces is not None:
            self._forget(replaces)

        def drop_replaced() -> None:
            if replaces is not None:
                self.states.discard(replaces, self.key.model_fingerprint)

        self.saver.save(sid, SavedState(self.key, list(tokens), payload), drop_replaced)
        self._add(sid, tokens)
        return sid
