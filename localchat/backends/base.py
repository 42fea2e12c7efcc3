"""What a turn needs from whatever writes the reply, and the data every backend hands back.

Two backends exist: llama.cpp in this process (``engine.Engine``) and an OpenAI-compatible
server (``remote.RemoteBackend``: vLLM, llama-server, Ollama, LM Studio). The transcript, the
context window and the figures are the same over both; only the local one holds a KV cache
that localchat saves and restores itself. A leaf: neither llama.cpp nor the network.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall, ToolUse


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; temperature 0 is greedy and deterministic."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int = 0


# Speculative decoding (backends/llama/drafting.py): "auto" drafts (by prompt lookup, and with
# a draft model if one is given) where replies stay exactly what they would be without it;
# "ngram" (prompt lookup only) and "draft" (the draft model only) draft anyway; "off" never.
SPECULATIVE_MODES = ("auto", "off", "ngram", "draft")


@dataclass
class TurnStats:
    """What one generation cost and what the KV cache holds afterwards.

    On a server the cache is the server's: ``kv_bytes_*`` are None, and ``server_kv_usage``
    is the fraction of its cache in use where the server publishes it (None otherwise).
    ``counted`` says where the token counts come from: ``"model"`` (the tokenizer),
    ``"server"`` (its usage report) or ``"estimated"`` (stream chunks or characters).
    """

    prompt_tokens: int = 0
    prompt_tokens_evaluated: int = 0
    generated_tokens: int = 0
    images_encoded: int = 0  # images the projector encoded reading the prompt (none kept)
    ttft_s: float = 0.0
    prompt_tps: float = 0.0
    gen_tps: float = 0.0
    kv_bytes_used: int | None = 0
    kv_bytes_allocated: int | None = 0
    stop_reason: str = ""
    server_kv_usage: float | None = None
    counted: str = "model"
    first_token_at: float | None = None  # when it came, on time.perf_counter's clock
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified
    accepted_tokens: int = 0  # of those, the ones the model kept (part of the reply)
    draft_steps: int = 0  # decodes that verified a draft
    # Generation's speed against single steps at this engine's measured cost (None: no draft)
    speculative_speedup: float | None = None
    # The process's CPU time over generation's wall time on every thread it ran (a local
    # model's): under the calibration's share, another program had the cores.
    gen_cpu_share: float | None = None


@dataclass(frozen=True)
class TokenDelta:
    """One generated token and the text it completes (empty mid-way through a UTF-8 char,
    or while it may be the start of a stop string). ``token`` is None for held-back text
    released when the reply ends, and for text a server sent (it sends no token ids)."""

    token: int | None
    text: str
    reasoning: bool = False  # part of a <think> block, not the answer


class Reply(Protocol):
    """A reply being written: iterate it for deltas; ``stats`` and ``text`` fill as it runs."""

    stats: TurnStats
    tool_calls: list[ToolCall]  # the calls the reply made (read when it ends)

    def __iter__(self) -> Iterator[TokenDelta]: ...

    @property
    def text(self) -> str: ...

    @property
    def tokens(self) -> list[int]:
        """The reply's token ids where the backend has them (a server: none)."""
        ...

    @property
    def answer(self) -> str: ...

    @property
    def reasoning(self) -> str: ...


@dataclass(frozen=True)
class BackendView:
    """How a backend shows itself: the app's title and model panel, ``ask --json``."""

    title: str  # "Smollm2 135M · Q4_1", "qwen2.5-7b · gpu-box"
    panel: str  # the model panel's lines
    model: str  # what answers
    template: str | None  # the chat template in use; None where a server renders its own
    server: str | None  # where it runs; None for this machine


@dataclass(frozen=True)
class CacheView:
    """The KV cache as the panel shows it: bytes held here, or the server's fill."""

    tokens: int  # what the context holds
    n_ctx: int | None  # None where the server does not say
    used_bytes: int | None = None  # None: the cache is the server's
    allocated_bytes: int | None = None
    server_usage: float | None = None  # the server's own fill, where it publishes one
    counted: bool = True  # False: the tokens are an estimate


@runtime_checkable
class Backend(Protocol):
    """What the conversation layer, the CLI and the app ask of either backend: who answers,
    how many tokens a text takes, a reply to messages (streamed, cancellable). The local
    engine also saves and restores its KV cache (``Engine.cache``: ``save_sequence_state``
    and ``load_sequence_state``); a server keeps its own."""

    @property
    def model_name(self) -> str:
        """What the transcript records as the model that answered."""
        ...

    @property
    def fingerprint(self) -> str:
        """Keys what is stored per model (token ids, window start)."""
        ...

    @property
    def context_size(self) -> int | None:
        """Tokens a prompt plus reply may hold; None where the server does not say."""
        ...

    @property
    def threads(self) -> int:
        """CPU threads a reply keeps busy here (a server's: one, the reader's)."""
        ...

    @property
    def frees_with_process(self) -> bool:
        """Whether all it holds is this process's memory, freed by exiting (a model loaded
        here): a quitting app need not close it. A server's client is closed."""
        ...

    def images_refused(self) -> str | None:
        """Why a message with images cannot go to this backend, in one line that says what
        to do (None: it reads them)."""
        ...

    def describe(self) -> BackendView:
        """What answers, in words for the app and ``ask --json``."""
        ...

    def cache_view(self, tokens: int, server_usage: float | None = None) -> CacheView:
        """The cache behind ``tokens`` of context, for the panel."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes (a server that cannot count: an estimate); any thread may
        ask (blocking: a local model counts on the compute thread, a server over the network)."""
        ...

    def stream(
        self,
        messages: Sequence[ChatMessage],
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        tool_use: ToolUse | None = None,
    ) -> Reply:
        """A reply to ``messages`` (the chat template applied by whoever answers), offered
        ``tool_use``'s tools where given."""
        ...

    def close(self) -> None: ...
