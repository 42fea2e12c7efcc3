"""A request's turn between the event loop and the compute thread, the same for every
API: admitted, its prompt made on a worker thread (a refusal comes before any stream
starts), then its typed events (``server.events``) handed to the loop in batches, and
gathered whole for a client that does not stream."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from localchat.backends.base import TurnStats
from localchat.chat.tools import ToolCall
from localchat.server.events import (
    Called,
    Event,
    Failed,
    Finished,
    Logprob,
    Piece,
    Reasoning,
    Text,
    TextEnd,
)
from localchat.server.requests import ApiError, GenerationRequest
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.server.slots import Job

DISCONNECT_POLL_S = 0.25
# A stream's pieces reach the client at most this often, those of the meantime together:
# each wake of the event loop and of the client preempts a llama.cpp thread on a small
# machine (per token they cost a stream ~5% of its speed on 2 cores; over a 300-token
# stream the loop took 0.07-0.09 s of CPU at 25 ms, 0.03-0.05 s at 50 ms, the client 0.03
# and 0.02 s). 20 updates a second read as smooth (the app redraws at most 10 times a
# second). The first piece and the end go out at once.
STREAM_INTERVAL_S = 0.05
_RUNNING: set[asyncio.Task[None]] = set()  # turns whose client left, still ending


class Turn:
    """One request's work, all of it on one worker thread: the prompt rendered and
    tokenized, then the reply, without a hand-back to the event loop between the two
    (beside running replies each hand-over waits for a time slice, and a request joining
    them paid two before its job was queued). ``prompt_ready`` says whether the prompt was
    taken; the reply's events come through ``batches()``."""

    def __init__(
        self, runner: ModelRunner, request: GenerationRequest, after: Job | None = None
    ) -> None:
        self.runner, self.request, self.after = runner, request, after
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self.prompt_ready: asyncio.Future[None] = self.loop.create_future()
        self.job: Job | None = None  # once the prompt is made
        self.load_s = 0.0  # how long it waited for its model to be loaded
        self._events = _Batches(self.loop)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            finished = await run_in_threadpool(self._work)
        except Exception as exc:
            self._events.put(Failed(exc))
            return
        self._events.put(finished)

    def _work(self) -> Finished:
        try:
            self.job = self.runner.job_of(self.request, self.cancel, self._events.put)
            self.job.after = self.after
        except BaseException as exc:
            self.runner.leave_queue()  # admitted, never queued
            self.loop.call_soon_threadsafe(_settle, self.prompt_ready, exc)
            raise
        self.loop.call_soon_threadsafe(_settle, self.prompt_ready, None)
        return self.runner.run(self.job)

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt) if self.job is not None else 0

    def batches(self) -> AsyncIterator[list[Event]]:
        """The reply's events, in batches, until one ends with ``Finished`` or ``Failed``."""
        return self._events.batches()

    def stop(self) -> None:
        """The client went away: the turn stops at its next token (or is never started);
        its task ends on its own."""
        self.cancel.set()
        _RUNNING.add(self.task)
        self.task.add_done_callback(_RUNNING.discard)


async def start_turn(models: Router, request: GenerationRequest, after: Job | None = None) -> Turn:
    """Admit ``request`` to the model it names (loaded if it is not; 503 where the queue
    is full or no room can be made) and make its prompt: an error in it (too long, a
    template's refusal) is raised here, before any response starts. ``after``: a job whose
    prompt this one shares (it starts once that one has read it)."""
    asked = time.perf_counter()
    runner = await models.admit(request.model, request.keep_alive_s)
    name = request.model if request.model in runner.names else runner.model_name
    turn = Turn(runner, replace(request, model=name), after)
    turn.load_s = time.perf_counter() - asked  # waiting for its model: loading it, if it was not
    try:
        await turn.prompt_ready
    except BaseException:
        turn.stop()
        raise
    return turn


@dataclass
class WholeReply:
    """A reply gathered for a client that does not stream."""

    text: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    logprobs: list[Logprob] = field(default_factory=list)
    finished: Finished = field(default_factory=lambda: Finished("stop", TurnStats()))


async def whole_reply(turn: Turn, http: Request) -> WholeReply:
    """All of ``turn``'s reply; a client that leaves meanwhile stops it; a failure raises.
    The text around tool calls is trimmed as OpenAI's and Anthropic's APIs give it."""
    watcher = asyncio.create_task(_cancel_when_gone(http, turn.cancel))
    text: list[str] = []
    reasoning: list[str] = []
    reply = WholeReply()
    try:
        async for batch in turn.batches():
            for event in batch:
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Text):
                    text.append(event.text)
                elif isinstance(event, Reasoning):
                    reasoning.append(event.text)
                elif isinstance(event, Called):
                    reply.calls = event.calls
                elif isinstance(event, Logprob):
                    reply.logprobs.append(event)
                elif isinstance(event, Finished):
                    reply.finished = event
    except BaseException:
        turn.stop()
        raise
    finally:
        watcher.cancel()
    reply.text = "".join(text).strip() if reply.calls else "".join(text)
    reply.reasoning = "".join(reasoning)
    return reply


async def stream_bytes(
    turn: Turn, head: bytes, write: Callable[[list[Event]], bytes]
) -> AsyncIterator[bytes]:
    """A streamed response: ``head`` at once, then each batch of events as ``write`` puts
    it (one write a batch); a client that goes away stops its sequence at once (what was
    generated stays in the cache)."""
    try:
        if head:
            yield head
        async for batch in turn.batches():
            data = write(batch)
            if data:
                yield data
    finally:
        turn.stop()  # the turn stops at its next token; its task ends on its own


async def start_choices(models: Router, request: GenerationRequest, n: int) -> list[Turn]:
    """``n`` replies to one request: the first reads the prompt, the others start from its
    cells (copied, not evaluated again), each with its own seed."""
    first = await start_turn(models, request)
    turns = [first]
    try:
        for index in range(1, n):
            sampling = replace(request.sampling, seed=request.sampling.seed + index)
            again = replace(request, sampling=sampling, model=first.request.model)
            turns.append(await start_turn(models, again, first.job))
    except BaseException:
        for turn in turns:
            turn.stop()
        raise
    return turns


async def stream_choices(
    turns: list[Turn], head: bytes, write: Callable[[int, list[Event]], bytes]
) -> AsyncIterator[bytes]:
    """Several replies streamed as one response: each batch of each as ``write`` puts it,
    with the reply's index, as they come; all stop when the client goes away."""
    queue: asyncio.Queue[tuple[int, list[Event]]] = asyncio.Queue()

    async def forward(index: int, turn: Turn) -> None:
        async for batch in turn.batches():
            await queue.put((index, batch))

    tasks = [asyncio.create_task(forward(i, turn)) for i, turn in enumerate(turns)]
    ended = 0
    try:
        if head:
            yield head
        while ended < len(turns):
            index, batch = await queue.get()
            ended += isinstance(batch[-1], _Batches.ENDS)
            data = write(index, batch)
            if data:
                yield data
    finally:
        for turn in turns:
            turn.stop()
        for task in tasks:
            task.cancel()


def failure(error: Exception) -> ApiError:
    """What a stream's client is told of a failure mid-reply."""
    if isinstance(error, ApiError):
        return error
    return ApiError(500, f"the server failed: {type(error).__name__}: {error}", "server_error")


class _Batches:
    """A reply's events from the compute thread to the event loop, in batches: the loop is
    woken when it waits for the first event or for the end, and otherwise collects what
    came every ``STREAM_INTERVAL_S`` (a wake per batch, not per token)."""

    ENDS = (Finished, Failed)
    WAKE = (TextEnd, Finished, Failed)  # TextEnd: the reply's text is all out

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[Event] = []
        self.waiting = True  # the loop found nothing and sleeps until woken
        self.wake = asyncio.Event()

    def put(self, event: Piece | Finished | Failed) -> None:
        """One event (any thread)."""
        with self.lock:
            self.pending.append(event)
            signal = self.waiting or isinstance(event, self.WAKE)
            self.waiting = False
        if signal:
            self.loop.call_soon_threadsafe(self.wake.set)

    async def batches(self) -> AsyncIterator[list[Event]]:
        while True:
            self.wake.clear()  # a wake from here on is news
            with self.lock:
                batch, self.pending = self.pending, []
                self.waiting = not batch
            if not batch:
                await self.wake.wait()
                continue
            yield batch
            if isinstance(batch[-1], self.ENDS):
                return
            with contextlib.suppress(TimeoutError):  # cut short by the end
                await asyncio.wait_for(self.wake.wait(), STREAM_INTERVAL_S)


def _settle(future: asyncio.Future[None], outcome: BaseException | None) -> None:
    if future.done():
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)


async def _cancel_when_gone(http: Request, cancel: threading.Event) -> None:
    """A whole-body request whose client left (a timeout, an editor's retry) stops its turn."""
    while not cancel.is_set():
        if await http.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)
