"""The model behind ``localchat serve``: requests answered one at a time on the compute
thread, each starting from the longest prefix it shares with the cache in memory or with a
state saved on disk, and leaving its own state saved for the next.

This first slice serves one sequence: requests queue (bounded; beyond the bound the caller
says 503) and run in order. The counters feed ``/metrics`` and the terminal's view.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localchat.backends.base import TokenDelta, TurnStats
from localchat.backends.llama.engine import Engine
from localchat.chat.prompt import common_prefix
from localchat.chat.stops import StopFilter
from localchat.server.api import DEFAULT_MAX_TOKENS, ApiError, GenerationRequest, finish_reason
from localchat.server.prompt_cache import BLOCK, PromptCache
from localchat.state.kvstate import BackgroundSaver, StateStore

# What the engine's run emits for a reply: ("text" | "reasoning", piece).
Emit = Callable[[str, str], None]
OWNER = "serve"  # the engine's cache owner while the server holds it


@dataclass
class Counters:
    """Totals since the server started (Prometheus counters) and what runs now."""

    requests: int = 0
    running: int = 0
    queued: int = 0
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

    endpoint: str  # "chat" or "completions"
    finish: str  # "stop", "length", "cancelled"
    prompt_tokens: int
    cached_tokens: int  # not evaluated: held in memory or restored from disk
    restored_tokens: int  # of those, restored from a state on disk
    completion_tokens: int
    ttft_ms: float
    gen_tps: float

    def line(self) -> str:
        return (
            f"{self.endpoint}: {self.prompt_tokens} prompt tokens ({self.cached_tokens} cached,"
            f" {self.restored_tokens} from disk), {self.completion_tokens} generated at"
            f" {self.gen_tps:.1f} tok/s, first token {self.ttft_ms:.0f} ms, {self.finish}"
        )


class ModelRunner:
    """One loaded model serving requests in turn, with its prompt cache on disk."""

    def __init__(
        self, engine: Engine, states: StateStore, model_name: str, max_queue: int = 16
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_queue = max_queue
        self.saver = BackgroundSaver(states)
        self.cache = PromptCache(states, engine.state_key, self.saver)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._held: tuple[str, list[int]] | None = None  # the saved state the cache continues
        self.on_turn: Callable[[TurnRecord], None] | None = None  # each answered request

    def aliases(self) -> set[str]:
        """Names a request's ``model`` may give: the served name and the file's."""
        path = self.engine.model_path
        return {self.model_name, path.name, path.stem}

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

    def started(self) -> None:
        with self._lock:
            self.counters.queued -= 1
            self.counters.running += 1

    def finished(self) -> None:
        with self._lock:
            self.counters.running -= 1

    def leave_queue(self) -> None:
        """A request that never started (refused, or its client went away)."""
        with self._lock:
            self.counters.queued -= 1

    # -- on the compute thread -------------------------------------------------------------
    def prompt_of(self, request: GenerationRequest) -> tuple[list[int], int]:
        """The request's prompt ids (the chat template rendered as ``ask`` renders it) and
        its reply's length; ``ApiError`` where the context cannot hold them."""
        engine = self.engine
        if request.messages is not None:
            prompt = engine.prompt_tokens(request.messages)
        else:
            prompt = engine.tokenize(request.prompt or "", add_bos=engine.add_bos, special=True)
        room = engine.n_ctx - len(prompt)
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens but the context holds {engine.n_ctx}",
                code="context_length_exceeded",
            )
        if request.max_tokens is not None and request.max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens {request.max_tokens} is past the context: the prompt takes"
                f" {len(prompt)} of {engine.n_ctx} tokens, {room} are left",
                code="context_length_exceeded",
            )
        return prompt, min(request.max_tokens or DEFAULT_MAX_TOKENS, room)

    def run(
        self,
        request: GenerationRequest,
        prompt: list[int],
        max_tokens: int,
        cancel: threading.Event,
        emit: Emit,
    ) -> TurnStats:
        """Generate the reply, emitting its pieces; the state is saved after it."""
        engine = self.engine
        engine.cache_owner = OWNER
        restored, continues = self._start_from_cache(prompt)
        if request.messages is None:  # a raw completion: any reasoning is just its text
            answer = emit

            def emit(_kind: str, text: str) -> None:
                answer("text", text)

        generation = engine.generate(prompt, request.sampling, max_tokens, cancel)
        stops = StopFilter(request.stop)
        stopped = False
        stream = generation.deltas()
        try:
            for delta in stream:
                stopped = self._emit(delta, stops, emit)
                if stopped:
                    break
        finally:
            stream.close()  # the reply so far stays in the cache
        if not stopped:
            tail = stops.flush()
            if tail:
                emit("text", tail)
        stats = generation.stats
        if stopped:
            stats.stop_reason = "stop"
        self._count(stats, restored)
        self._save(continues)
        if self.on_turn is not None:
            self.on_turn(
                TurnRecord(
                    "chat" if request.messages is not None else "completions",
                    "cancelled" if cancel.is_set() else finish_reason(stats),
                    stats.prompt_tokens,
                    stats.prompt_tokens - stats.prompt_tokens_evaluated,
                    restored,
                    stats.generated_tokens,
                    round(stats.ttft_s * 1000, 1),
                    round(stats.gen_tps, 1),
                )
            )
        return stats

    def _emit(self, delta: TokenDelta, stops: StopFilter, emit: Emit) -> bool:
        if delta.reasoning:
            emit("reasoning", delta.text)
            return False
        text, stopped = stops.feed(delta.text)
        if text:
            emit("text", text)
        return stopped

    def _start_from_cache(self, prompt: list[int]) -> tuple[int, str | None]:
        """Restore a saved state where it holds more of ``prompt`` than the cache in memory:
        (tokens restored from disk, the saved state this request's own will extend)."""
        engine = self.engine
        in_memory = common_prefix(engine.cached_tokens, prompt)
        restored = 0
        hit = self.cache.lookup(prompt, beyond=in_memory)
        # A window cache cannot be cut back far: there only a state wholly inside the prompt.
        if hit is not None and (not engine.windowed or hit.shared == len(hit.state.tokens)):
            state = hit.state
            if engine.load_sequence_state(state.payload, state.tokens):
                self._held = (hit.state_id, list(state.tokens))
                restored = min(hit.shared, len(prompt) - 1)
        held = self._held
        continues = None
        if held is not None and common_prefix(held[1], prompt) == len(held[1]):
            continues = held[0]  # this request extends that state: it replaces it
        return restored, continues

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

    def _save(self, replaces: str | None) -> None:
        """Save what the cache holds (the prompt and the reply) in the background."""
        engine = self.engine
        tokens = engine.cached_tokens
        held = self._held
        if len(tokens) < BLOCK or (
            replaces is not None and held is not None and len(tokens) < len(held[1]) + BLOCK
        ):
            return  # short, or less than a block past the state it continues: not worth a write
        sid = self.cache.save(tokens, engine.save_sequence_state(), replaces)
        if sid is not None:
            self._held = (sid, tokens)

    # -- what /metrics shows ---------------------------------------------------------------
    def metrics(self) -> str:
        """Prometheus text, under llama-server's names where one exists."""
        engine = self.engine
        with self._lock:
            c = self.counters
            rows = [
                ("llamacpp:kv_cache_usage_ratio", "gauge", "KV cache fill (1 is full)",
                 len(engine.cached_tokens) / max(1, engine.n_ctx)),
                ("llamacpp:kv_cache_tokens", "gauge", "tokens in the KV cache",
                 len(engine.cached_tokens)),
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
            ]  # fmt: skip
        lines = []
        for name, kind, text, value in rows:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Finish the saves under way (a stopped server keeps every state it promised)."""
        self.saver.close()
