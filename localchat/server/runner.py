"""The model behind ``localchat serve``: up to ``parallel`` requests answered side by side
(``Scheduler``: continuous batching), each starting from the longest prefix it shares with
a sequence in memory or a state saved on disk, and leaving its own state saved for the next.
More requests queue (bounded; beyond the bound the caller says 503). The counters feed
``/metrics`` and the terminal's view.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from localchat.backends.base import TurnStats
from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.batch import SequenceBatch
from localchat.backends.llama.engine import Engine
from localchat.backends.llama.image_positions import image_start_before
from localchat.chat.prompt import common_prefix
from localchat.chat.tools import markers
from localchat.errors import ModelFileError, UsageError
from localchat.server.events import Finished
from localchat.server.prompt_cache import PromptCache
from localchat.server.requests import DEFAULT_MAX_TOKENS, ApiError, GenerationRequest
from localchat.server.scheduler import Scheduler
from localchat.server.slots import Emit, Job
from localchat.state.images import ImageMissing
from localchat.state.kvstate import BackgroundSaver, StateStore

# How the request log names a reply's end ("stop", "length", "tool_calls", "cancelled").
_LOGGED_ENDS = {"stop_sequence": "stop", "context": "length"}
MAX_PARALLEL_CPU = 4  # sequences a CPU decodes together before a step costs as much as more
KV_SHARE_OF_FREE_RAM = 0.5  # of the memory free after the load, what sequences may take


def default_parallel(engine: Engine, available_bytes: int) -> int:
    """Sequences for ``--parallel`` when none is asked: what memory allows for the context
    (each sequence has a cache of its own), at most ``MAX_PARALLEL_CPU``."""
    per_sequence = max(1, engine.kv_bytes_per_token * engine.planned_ctx)
    fits = int(available_bytes * KV_SHARE_OF_FREE_RAM) // per_sequence
    return max(1, min(MAX_PARALLEL_CPU, fits))


@dataclass
class Counters:
    """Totals since the server started (Prometheus counters) and what runs now."""

    requests: int = 0
    running: int = 0
    queued: int = 0
    peak_running: int = 0  # the most requests answered at once
    prompt_tokens: int = 0
    evaluated_tokens: int = 0
    reused_tokens: int = 0  # held in memory from the request before
    restored_tokens: int = 0  # restored from a state on disk
    generated_tokens: int = 0
    generation_s: float = 0.0
    last: dict[str, float] = field(default_factory=dict)  # the last request's figures


@dataclass(frozen=True)
class TurnRecord:
    """One answered request, as the log shows it."""

    model: str  # the model that answered
    endpoint: str  # the API asked: "chat", "completions", "messages", …
    finish: str  # "stop", "length", "tool_calls", "cancelled"
    prompt_tokens: int
    cached_tokens: int  # not evaluated: held in memory or restored from disk
    restored_tokens: int  # of those, restored from a state on disk
    completion_tokens: int
    ttft_ms: float
    gen_tps: float

    def line(self) -> str:
        return (
            f"{self.model} {self.endpoint}: {self.prompt_tokens} prompt tokens ({self.cached_tokens} cached,"
            f" {self.restored_tokens} from disk), {self.completion_tokens} generated at"
            f" {self.gen_tps:.1f} tok/s, first token {self.ttft_ms:.0f} ms, {self.finish}"
        )


class ModelRunner:
    """One loaded model serving requests side by side, with its prompt cache on disk."""

    def __init__(
        self,
        engine: Engine,
        states: StateStore,
        model_name: str,
        max_queue: int = 16,
        parallel: int = 1,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # The names the model is listed under (``--alias``): a request that gives one is
        # answered under it; any other name is answered under ``model_name``.
        self.names = (model_name, *(a for a in aliases if a != model_name))
        self.max_queue = max_queue
        self.parallel = parallel
        self.saver = BackgroundSaver(states)
        self.batch = run_compute(SequenceBatch, engine, parallel, engine.planned_ctx)
        # A saved state depends on a sequence's context (the engine's own may be smaller).
        key = replace(engine.state_key, n_ctx=self.batch.n_ctx_seq)
        self.cache = PromptCache(states, key, self.saver)
        self.counters = Counters()
        self._lock = threading.Lock()
        self.scheduler = Scheduler(self.batch, self.cache, self._started, self._finished)
        self.on_turn: Callable[[TurnRecord], None] | None = None  # each answered request
        self.on_idle: Callable[[], None] | None = None  # the last request running ended

    @property
    def active(self) -> bool:
        """Whether a request is queued or running on it (read whole, under the lock)."""
        with self._lock:
            return self.counters.queued > 0 or self.counters.running > 0

    @property
    def memory_bytes(self) -> int:
        """What the model holds in memory: its weights (the file) and its sequences' KV
        caches, allocated whole (the engine's own small context aside)."""
        cells = self.batch.n_ctx_seq * self.batch.n_seq
        return self.engine.model_path.stat().st_size + cells * self.engine.kv_bytes_per_token

    def restore_newest(self) -> int:
        """Put the states saved last back into the sequences before serving: a restarted
        server continues the conversations it answered last from memory (read on request,
        a 2,000-token state made the first one wait 0.22-0.25 s where a warm server took
        0.15-0.18 s). How many were put back."""
        return run_compute(self.scheduler.hold, self.cache.newest(self.batch.n_seq))

    # -- admission -------------------------------------------------------------------------
    def admit(self) -> None:
        """Count a request in, or refuse it (503) when the queue is full."""
        with self._lock:
            if self.counters.queued >= self.max_queue:
                raise ApiError(
                    503,
                    f"the server is busy: {self.counters.queued} requests wait; retry shortly",
                    "server_busy",
                    "queue_full",
                )
            self.counters.queued += 1
            self.counters.requests += 1
        self.scheduler.expect()

    def leave_queue(self) -> None:
        """A request that never reached the scheduler (refused, or its client went away)."""
        with self._lock:
            self.counters.queued -= 1
        self.scheduler.unexpect()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        with self._lock:
            idle = self.counters.queued == 0 and self.counters.running == 0
        if idle and self.on_idle is not None:
            with contextlib.suppress(Exception):  # never a reply's end that fails
                self.on_idle()

    def _started(self, _job: Job) -> None:
        with self._lock:
            self.counters.queued -= 1
            self.counters.running += 1
            self.counters.peak_running = max(self.counters.peak_running, self.counters.running)

    def _finished(self, job: Job) -> None:
        with self._lock:
            if job.started:
                self.counters.running -= 1
            else:
                self.counters.queued -= 1
        if job.started and job.error is None:
            self._count(job.stats, job.restored)
            if self.on_turn is not None:
                with contextlib.suppress(Exception):  # a log that cannot be written
                    self.on_turn(self._record(job))
        self._maybe_idle()

    # -- a request -------------------------------------------------------------------------
    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's prompt ids: the chat template rendered as ``ask`` renders it, or
        the text as it is (any worker thread: the tokenizer reads the vocabulary only)."""
        engine = self.engine
        if request.prompt_ids is not None:
            if max(request.prompt_ids) >= engine.n_vocab:
                raise ApiError(400, f"prompt: token ids run from 0 to {engine.n_vocab - 1}",
                               code="invalid_value")  # fmt: skip
            return list(request.prompt_ids)
        if request.messages is None:
            return engine.tokenize(request.prompt or "", add_bos=engine.add_bos, special=True)
        refused = engine.images_refused()
        if refused and any(message.images for message in request.messages):
            raise ApiError(400, refused, code="unsupported_content")
        try:
            return engine.prompt_tokens(request.messages, list(request.tool_use.tools) or None)
        except (ModelFileError, UsageError) as exc:  # the template refused these messages
            raise ApiError(400, str(exc), code="invalid_value") from None
        except ImageMissing as exc:  # an image a stored response showed, deleted since
            raise ApiError(400, f"{exc}; send the image again", code="invalid_image") from None

    def prompt_of(self, request: GenerationRequest) -> tuple[list[int], int]:
        """The request's prompt ids and its reply's length; ``ApiError`` where a
        sequence's context cannot hold them."""
        prompt = self.prompt_ids(request)
        n_ctx = min(self.batch.n_ctx_seq, request.context_limit or self.batch.n_ctx_seq)
        room = n_ctx - len(prompt)
        if room <= 0 or not prompt:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}",
                code="context_length_exceeded",
            )
        if prompt[-1] < 0:  # an image's cells give no logits to start the reply from
            raise ApiError(400, "the prompt ends with an image: add text after it",
                           code="invalid_value")  # fmt: skip
        if request.max_tokens is not None and request.max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens {request.max_tokens} is past the context: the prompt takes"
                f" {len(prompt)} of {n_ctx} tokens, {room} are left",
                code="context_length_exceeded",
            )
        return prompt, min(request.max_tokens or DEFAULT_MAX_TOKENS, room)

    def job_of(self, request: GenerationRequest, cancel: threading.Event, emit: Emit) -> Job:
        """The request made ready to answer, all of it on the calling worker thread: its
        prompt (``prompt_of``), its grammar where a call is required (``ApiError`` where it
        cannot be had), and a saved state from disk where one holds more of the prompt than
        memory does (so the running sequences do not wait for the disk)."""
        prompt, max_tokens = self.prompt_of(request)
        job = Job(request, prompt, max_tokens, cancel, emit)
        tool_use = request.tool_use
        if tool_use.reads_calls:  # the family's markers stay in the text, to be parsed
            family = self.engine.template.tool_family
            job.spelled = self.engine.spelled_tokens(markers(family))
        job.grammar = self._grammar(request)
        in_memory = max(common_prefix(tokens, prompt) for tokens in list(self.batch.tokens))
        job.hit = self.cache.lookup(prompt, beyond=in_memory)
        found = max(in_memory, job.hit.shared if job.hit is not None else 0)
        job.expected_cached = image_start_before(prompt, min(found, len(prompt) - 1))
        return job

    def _grammar(self, request: GenerationRequest) -> str | None:
        """The grammar a reply must follow: a call where one is required, the format asked
        for, or the client's own; ``ApiError`` where one gives none (or two are asked)."""
        tool_use, schema = request.tool_use, request.output_schema
        asked = [tool_use.forced, schema is not None, request.grammar is not None]
        if sum(asked) > 1:
            raise ApiError(400, "a required tool call, a response format and a grammar each"
                           " hold the whole reply: ask for one of them", code="invalid_value")  # fmt: skip
        try:
            if tool_use.forced:
                return self.engine.call_grammar(tool_use)
            if schema is not None:
                return self.engine.format_grammar(schema)
            if request.grammar is not None:
                return self.engine.given_grammar(request.grammar)
        except UsageError as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        return None

    def run(self, job: Job) -> Finished:
        """Answer a job of ``job_of`` (waiting for a sequence, then beside the others),
        emitting its pieces; its state is saved after it. Blocks the calling worker
        thread; how the reply ended."""
        return self.scheduler.answer(job)

    def _record(self, job: Job) -> TurnRecord:
        stats = job.stats
        return TurnRecord(
            self.model_name,
            job.request.endpoint,
            _LOGGED_ENDS.get(job.reason, job.reason),
            stats.prompt_tokens,
            stats.prompt_tokens - stats.prompt_tokens_evaluated,
            job.restored,
            stats.generated_tokens,
            round(stats.ttft_s * 1000, 1),
            round(stats.gen_tps, 1),
        )

    def _count(self, stats: TurnStats, restored: int) -> None:
        with self._lock:
            counters = self.counters
            counters.prompt_tokens += stats.prompt_tokens
            counters.evaluated_tokens += stats.prompt_tokens_evaluated
            reused = stats.prompt_tokens - stats.prompt_tokens_evaluated
            counters.restored_tokens += min(restored, reused)
            counters.reused_tokens += max(0, reused - restored)
            counters.generated_tokens += stats.generated_tokens
            if stats.gen_tps > 0:
                counters.generation_s += stats.generated_tokens / stats.gen_tps
            counters.last = {"gen_tps": stats.gen_tps, "restored": restored, "at": time.time()}

    # -- what /metrics shows ---------------------------------------------------------------
    def metric_rows(self) -> list[tuple[str, str, str, float]]:
        """(name, kind, help, value) for ``/metrics``, under llama-server's names where one
        exists."""
        batch = self.batch
        used = batch.cells_used
        with self._lock:
            c = self.counters
            rows = [
                ("llamacpp:kv_cache_usage_ratio", "gauge", "KV cache fill (1 is full)",
                 used / max(1, batch.n_ctx_seq * batch.n_seq)),
                ("llamacpp:kv_cache_tokens", "gauge", "tokens in the KV cache", used),
                ("llamacpp:prompt_tokens_total", "counter", "prompt tokens evaluated",
                 c.evaluated_tokens),
                ("llamacpp:tokens_predicted_total", "counter", "tokens generated",
                 c.generated_tokens),
                ("llamacpp:predicted_tokens_seconds", "gauge", "average generation tokens/s",
                 c.generated_tokens / c.generation_s if c.generation_s else 0.0),
                ("llamacpp:requests_processing", "gauge", "requests running", c.running),
                ("llamacpp:requests_deferred", "gauge", "requests waiting", c.queued),
                ("localchat:prompt_tokens_cached_total", "counter",
                 "prompt tokens held in memory from the request before", c.reused_tokens),
                ("localchat:prompt_tokens_restored_total", "counter",
                 "prompt tokens restored from a state saved on disk", c.restored_tokens),
                ("localchat:saved_states", "gauge", "prompt states saved on disk",
                 len(self.cache)),
                ("localchat:saves_pending", "gauge", "states queued or being written to disk",
                 self.saver.pending),
                ("localchat:steps_interrupted_total", "counter",
                 "generating steps given up midway for a request that arrived",
                 self.scheduler.interrupted_steps),
            ]  # fmt: skip
        return rows

    def close(self) -> None:
        """Finish the saves under way (a stopped server keeps every state it promised, and
        each sequence's whole state), then free the sequences' context (the engine is the
        caller's). Replies still under way stop at their next step; their states are saved
        too."""
        self.scheduler.close()
        try:
            run_compute(self.scheduler.save_unsaved)  # after the loop has let go of the thread
        finally:
            run_compute(self.batch.close)
            self.saver.close()
