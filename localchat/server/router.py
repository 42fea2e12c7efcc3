"""Many models behind one server: which are loaded, loading one on demand (once, however
many requests ask for it at the same time), making room by unloading the least recently
used idle model, and unloading a model that stayed idle past its ``keep_alive``. Before a
model's memory is freed its sequences' states are saved (``ModelRunner.close``), so a
conversation that comes back restores them from disk instead of reading its history
again. A model answering a request is never unloaded: a request that cannot be placed
waits (bounded), then gets a 503 with ``Retry-After``.

Loads and unloads run one at a time on their own thread (the model's own work goes to the
compute thread), so memory freed by an unload is free before the next load begins.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from localchat.backends.compute_thread import run_compute
from localchat.errors import LocalchatError, UsageError, one_line
from localchat.heap import release_free_heap
from localchat.server.requests import ApiError
from localchat.server.runner import ModelRunner, TurnRecord

FOREVER = -1.0  # a keep_alive that never unloads
WAIT_S = 30.0  # how long a request waits for room before its 503
POLL_S = 0.05  # how often a waiting request looks again
REAP_S = 0.5  # how often idle models are checked against their keep_alive
LOADS_THREAD = "model-loads"


LOAD_ERRORS = (LocalchatError, OSError, ValueError, RuntimeError)


@dataclass(frozen=True)
class ServedEntry:
    """A model the server can serve: the name it is listed and answered under, its file,
    other names it is listed under (``--alias``), and names a request may give for it that
    are not listed (the catalog's ``NAME:QUANT``, the file's stem)."""

    name: str
    path: Path
    aliases: tuple[str, ...] = ()
    unlisted: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The names the listings show."""
        return (self.name, *(a for a in self.aliases if a != self.name))

    @property
    def answers_to(self) -> tuple[str, ...]:
        """Every name a request may give."""
        return (*self.names, *(u for u in self.unlisted if u not in self.names))


def load_error(entry: ServedEntry, exc: BaseException) -> ApiError:
    """A model that cannot be loaded, as its request's error: a 400 for an option it cannot
    take, else a 500; one line naming the file and the cause."""
    if isinstance(exc, UsageError):
        return ApiError(400, f"{entry.name} cannot be loaded: {one_line(exc)}",
                        code="model_load_failed")  # fmt: skip
    cause = one_line(exc)
    text = cause if str(entry.path) in cause else f"{entry.path} failed to load: {cause}"
    return ApiError(500, text, "server_error", "model_load_failed")


class RunnerSource(Protocol):
    """How the router loads a model and knows what one takes."""

    def load(self, entry: ServedEntry) -> ModelRunner:
        """The model loaded and ready to serve (blocking; ``LocalchatError`` says why not)."""
        ...

    def needed_bytes(self, entry: ServedEntry) -> int:
        """Memory the model will take once loaded, from the same estimate ``hw`` makes."""
        ...

    def free_bytes(self) -> int:
        """Memory free on the machine now."""
        ...


@dataclass
class _Slot:
    entry: ServedEntry
    runner: ModelRunner | None = None
    loading: Future[ModelRunner] | None = None
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float | None = None  # the last request's, else ``own_keep_alive_s``
    own_keep_alive_s: float | None = None  # the model's own (None: the router's)
    held: int = 0  # requests holding it without a turn (counting tokens, a load request)
    waiters: int = 0  # requests waiting for its load: it is theirs once loaded
    needed: int | None = None  # bytes, once estimated

    @property
    def busy(self) -> bool:
        runner = self.runner
        if runner is None:
            return False
        return self.held > 0 or self.waiters > 0 or runner.active


@dataclass(frozen=True)
class ModelStatus:
    """One model as the listings show it."""

    entry: ServedEntry
    state: str  # "loaded", "loading" or "unloaded"
    runner: ModelRunner | None
    idle_s: float | None  # since its last request ended (None: answering, or not loaded)
    expires_in_s: float | None  # until keep_alive unloads it (None: never, or not loaded)
    waiters: int = 0  # requests waiting for it to be loaded


class Router:
    """The models a server serves, loaded on demand (``source``) within memory and
    ``max_models``; ``keep_alive_s``: how long an idle model stays loaded (``FOREVER``:
    until room is needed). ``any_name``: a request naming a model this server does not
    know gets the default one (a server of one model answers clients that hard-code
    another's name); else a 404 lists the names. ``default``: the model a request that
    names none gets (None: the one used last)."""

    def __init__(
        self,
        entries: list[ServedEntry],
        source: RunnerSource | None,
        keep_alive_s: float = FOREVER,
        max_models: int | None = None,
        any_name: bool = False,
        wait_s: float = WAIT_S,
        default: str | None = None,
    ) -> None:
        if not entries:
            raise UsageError("no model to serve: `localchat pull` one, or give --model")
        self.source = source
        self.keep_alive_s = keep_alive_s
        self.max_models = max_models
        self.any_name = any_name
        self.wait_s = wait_s
        self._default = default  # None: the model used last
        self._slots = {entry.name: _Slot(entry) for entry in entries}
        self._lock = threading.Lock()
        self._loads = ThreadPoolExecutor(1, thread_name_prefix=LOADS_THREAD)
        self._closed = threading.Event()
        self.on_turn: Callable[[TurnRecord], None] | None = None  # each answered request
        self._reaper = threading.Thread(target=self._reap, name="keep-alive", daemon=True)
        self._reaper.start()

    @classmethod
    def of_one(cls, runner: ModelRunner) -> Router:
        """A router over one model already loaded, kept loaded, answering any name."""
        entry = ServedEntry(runner.model_name, runner.engine.model_path, runner.names[1:])
        router = cls([entry], None, any_name=True)
        router.adopt(entry.name, runner)
        return router

    def adopt(self, name: str, runner: ModelRunner, keep_alive_s: float | None = None) -> None:
        """``runner``, loaded by the caller, serves ``name`` from now on."""
        with self._lock:
            slot = self._slots[name]
            slot.runner = runner
            slot.keep_alive_s = slot.own_keep_alive_s = keep_alive_s
            slot.needed = runner.memory_bytes
            slot.last_used = time.monotonic()
        self._watch(name, runner)

    def _watch(self, name: str, runner: ModelRunner) -> None:
        runner.on_idle = lambda: self._went_idle(name)
        runner.on_turn = lambda record: self.on_turn(record) if self.on_turn else None

    # -- names ------------------------------------------------------------------------------
    @property
    def entries(self) -> list[ServedEntry]:
        return [slot.entry for slot in self._slots.values()]

    @property
    def default(self) -> ServedEntry:
        """What a request that names no model gets: the one named first (``--model``),
        else the model used last, else the first."""
        if self._default is not None:
            return self._slots[self._default].entry
        with self._lock:
            loaded = [s for s in self._slots.values() if s.runner is not None]
            if loaded:
                return max(loaded, key=lambda s: s.last_used).entry
        return next(iter(self._slots.values())).entry

    def entry_of(self, name: str | None) -> ServedEntry:
        """The model a request names (by a listed name or alias, with or without Ollama's
        ``:latest``); no name: the default. ``ApiError`` 404 names the models there are."""
        if not name:
            return self.default
        for wanted in (name, name.removesuffix(":latest")):
            for slot in self._slots.values():
                if wanted in slot.entry.answers_to:
                    return slot.entry
        if self.any_name:
            return self.default
        names = ", ".join(slot.entry.name for slot in self._slots.values())
        raise ApiError(404, f"model {name!r} is not served here; the models are: {names}"
                       " (`localchat models` lists them)", code="model_not_found")  # fmt: skip

    # -- taking a model ---------------------------------------------------------------------
    async def admit(self, name: str | None, keep_alive_s: float | None = None) -> ModelRunner:
        """The runner of the model ``name`` asks for, loaded if it is not, with the request
        counted in (``ModelRunner.admit``: a 503 where its queue is full), so it is not
        unloaded under it. ``keep_alive_s``: how long it stays loaded once idle, from now."""
        entry = self.entry_of(name)

        def take(slot: _Slot, runner: ModelRunner) -> None:
            runner.admit()
            slot.keep_alive_s = slot.own_keep_alive_s if keep_alive_s is None else keep_alive_s

        return await self._runner(entry, take)

    @asynccontextmanager
    async def hold(self, name: str | None) -> AsyncIterator[ModelRunner]:
        """The model's runner (loaded if it is not), kept loaded while the block runs:
        counting a prompt's tokens, tokenizing."""
        entry = self.entry_of(name)

        def take(slot: _Slot, _runner: ModelRunner) -> None:
            slot.held += 1

        runner = await self._runner(entry, take)
        try:
            yield runner
        finally:
            with self._lock:
                self._slots[entry.name].held -= 1
            self._went_idle(entry.name)

    async def _runner(
        self, entry: ServedEntry, take: Callable[[_Slot, ModelRunner], None]
    ) -> ModelRunner:
        deadline = time.monotonic() + self.wait_s
        await self._estimate(entry)
        waited = False  # counted among the slot's waiters (kept until taken, under the lock)
        while True:
            with self._lock:
                slot = self._slots[entry.name]
                if waited:
                    slot.waiters -= 1
                    waited = False
                if slot.runner is not None:
                    take(slot, slot.runner)  # under the lock: never unloaded in between
                    slot.last_used = time.monotonic()
                    return slot.runner
                if slot.loading is None:
                    making_room = self._room_for(slot)
                    if making_room is not None:
                        slot.loading = self._loads.submit(self._load, slot, making_room)
                loading = slot.loading
                if loading is not None:
                    slot.waiters += 1  # once loaded it is not taken from under this request
                    waited = True
            if loading is not None:
                try:
                    await self._loaded(entry, loading)
                except BaseException:
                    with self._lock:
                        slot.waiters -= 1
                    raise
                continue
            if time.monotonic() > deadline:
                raise ApiError(503, f"{entry.name} cannot be loaded now: the models in memory"
                               " are answering requests; retry shortly", "server_busy",
                               "no_room")  # fmt: skip
            await asyncio.sleep(POLL_S)

    async def _estimate(self, entry: ServedEntry) -> None:
        """What the model will take, estimated once, off the event loop (headers read)."""
        slot = self._slots[entry.name]
        if slot.needed is not None or slot.runner is not None or self.source is None:
            return
        try:
            needed = await asyncio.to_thread(self.source.needed_bytes, entry)
        except LOAD_ERRORS as exc:
            raise load_error(entry, exc) from None
        with self._lock:
            slot.needed = needed

    @staticmethod
    async def _loaded(entry: ServedEntry, loading: Future[ModelRunner]) -> None:
        try:  # shielded: a request that goes away never cancels a load others wait for
            await asyncio.shield(asyncio.wrap_future(loading))
        except LOAD_ERRORS as exc:
            raise load_error(entry, exc) from None

    # -- room -------------------------------------------------------------------------------
    def _room_for(self, slot: _Slot) -> list[ModelRunner] | None:
        """The runners to unload so ``slot``'s model fits (least recently used idle ones
        first), taken out of their slots here; None where only busy ones could make room
        (the request waits). Under the lock."""
        if self.source is None:
            raise ApiError(404, f"{slot.entry.name} is not loaded", code="model_not_loaded")
        needed = slot.needed or 0  # estimated before (``_estimate``)
        loaded = [s for s in self._slots.values() if s.runner is not None]
        # Loads under way count as loaded: their memory is not taken yet, but will be.
        coming = [s for s in self._slots.values() if s.loading is not None]
        idle = sorted((s for s in loaded if not s.busy), key=lambda s: s.last_used)
        free = self.source.free_bytes() - sum(s.needed or 0 for s in coming)
        victims: list[_Slot] = []
        while self._too_many(len(loaded) + len(coming) - len(victims)) or (
            needed > free and len(victims) < len(loaded) + len(coming)
        ):
            if not idle:
                return None
            victim = idle.pop(0)
            victims.append(victim)
            free += victim.needed or 0
        runners = []
        for victim in victims:
            assert victim.runner is not None
            runners.append(victim.runner)
            victim.runner = None
        return runners

    def _too_many(self, loaded: int) -> bool:
        return self.max_models is not None and loaded >= self.max_models

    def _load(self, slot: _Slot, unload_first: list[ModelRunner]) -> ModelRunner:
        """On the loads thread: free the models making room, then load this one."""
        try:
            for victim in unload_first:
                self._free(victim)
            assert self.source is not None
            runner = self.source.load(slot.entry)
        except BaseException:
            with self._lock:
                slot.loading = None
            raise
        with self._lock:
            slot.loading = None
            slot.runner = runner
            slot.last_used = time.monotonic()
        self._watch(slot.entry.name, runner)
        return runner

    @staticmethod
    def _free(runner: ModelRunner) -> None:
        """Save the model's sequences, then free its memory (and hand freed heap back). A
        save that fails is said on stderr and the memory freed all the same: one model's
        disk trouble never stops another from loading."""
        try:
            runner.close()
        except Exception as exc:
            print(f"localchat: {runner.model_name}: its states were not all saved:"
                  f" {one_line(exc)}", file=sys.stderr)  # fmt: skip
        finally:
            run_compute(runner.engine.close)
            release_free_heap()

    def keep(self, name: str, keep_alive_s: float | None) -> None:
        """``name``'s model stays loaded this long once idle (None: its own)."""
        with self._lock:
            slot = self._slots[name]
            slot.keep_alive_s = slot.own_keep_alive_s if keep_alive_s is None else keep_alive_s

    # -- unloading --------------------------------------------------------------------------
    def unload(self, name: str | None, wait_s: float | None = None) -> bool:
        """Unload ``name``'s model once it is idle (waiting at most ``wait_s``, default the
        router's); False where it was not loaded. ``ApiError`` 409 where it stayed busy."""
        entry = self.entry_of(name)
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        while True:
            with self._lock:
                slot = self._slots[entry.name]
                runner = slot.runner
                if runner is not None and not slot.busy:
                    slot.runner = None
                    # Queued now, under the lock: a load of it asked next comes after.
                    freeing = (
                        None if self._on_loads_thread() else self._loads.submit(self._free, runner)
                    )
                    break
                loading = slot.loading
            if runner is None and loading is None:
                return False
            if time.monotonic() > deadline:
                raise ApiError(409, f"{entry.name} is answering requests; unload it when"
                               " they end", code="model_busy")  # fmt: skip
            time.sleep(POLL_S)
        if freeing is None:
            self._free(runner)  # already on the loads thread (a keep_alive of 0)
        else:
            freeing.result()
        return True

    @staticmethod
    def _on_loads_thread() -> bool:
        return threading.current_thread().name.startswith(LOADS_THREAD)

    def _went_idle(self, name: str) -> None:
        """A request on ``name`` ended: its idle time starts now (a keep_alive of 0 unloads
        it now, on the loads thread)."""
        with self._lock:
            slot = self._slots[name]
            slot.last_used = time.monotonic()
            now = slot.keep_alive_s == 0 or (slot.keep_alive_s is None and self.keep_alive_s == 0)
        if now and not self._closed.is_set():
            with suppress(RuntimeError):  # the server is stopping: its close frees it
                self._loads.submit(self._unload_expired)

    def _unload_expired(self) -> None:
        for name in self._expired(time.monotonic()):
            with suppress(ApiError):
                self.unload(name, wait_s=0)

    def reap_now(self) -> None:
        """Unload what has expired, after the loads and unloads already asked for."""
        self._loads.submit(self._unload_expired).result()

    def _expired(self, now: float) -> list[str]:
        with self._lock:
            names = []
            for name, slot in self._slots.items():
                keep = self.keep_alive_s if slot.keep_alive_s is None else slot.keep_alive_s
                if slot.runner is None or slot.busy or keep < 0:
                    continue
                if now - slot.last_used >= keep:
                    names.append(name)
            return names

    def _reap(self) -> None:
        """Unload the models idle past their keep_alive (its own thread, for the server's
        life: a failure is said and the next round goes on)."""
        while not self._closed.wait(REAP_S):
            try:
                self._unload_expired()
            except Exception as exc:
                print(f"localchat: keep_alive: {one_line(exc)}", file=sys.stderr)

    # -- listings ---------------------------------------------------------------------------
    def statuses(self) -> list[ModelStatus]:
        now = time.monotonic()
        rows = []
        with self._lock:
            for slot in self._slots.values():
                runner = slot.runner
                state = "loaded" if runner else "loading" if slot.loading else "unloaded"
                idle = None if runner is None or slot.busy else now - slot.last_used
                keep = self.keep_alive_s if slot.keep_alive_s is None else slot.keep_alive_s
                expires = None if idle is None or keep < 0 else max(0.0, keep - idle)
                rows.append(ModelStatus(slot.entry, state, runner, idle, expires, slot.waiters))
        return rows

    def loaded(self) -> list[ModelRunner]:
        with self._lock:
            return [s.runner for s in self._slots.values() if s.runner is not None]

    def close(self) -> None:
        """Save every loaded model's states and free it (the server is stopping): the
        keep_alive thread and the loads under way end first."""
        self._closed.set()
        self._reaper.join(timeout=60)
        self._loads.shutdown(wait=True)
        with self._lock:
            runners = [s.runner for s in self._slots.values() if s.runner is not None]
            for slot in self._slots.values():
                slot.runner = None
        for runner in runners:
            self._free(runner)
