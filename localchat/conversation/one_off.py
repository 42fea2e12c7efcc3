"""A reply no conversation keeps (the CLI's one-off ``ask``): a local model starts a long
enough system prompt (or attached files) from its saved prefix state, saving it the first
time; a server just answers. Which of the two happens is decided here, in the layer that
knows both, so the callers hold a ``Backend`` and never ask which.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from localchat.backends.base import Backend, Reply, Sampling, TokenDelta
from localchat.backends.llama.engine import Engine
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolUse
from localchat.conversation.prefix_states import (
    DEFAULT_MIN_TOKENS,
    prefix_spans,
    start_from_prefix,
)
from localchat.conversation.turn import RestoreReport, turn_stats_dict
from localchat.state.kvstate import StateStore


@dataclass
class OneOffTurn:
    """A reply outside any conversation (``ask_once``): iterate it for deltas; its figures
    after, as ``ask --json`` reports them."""

    generation: Reply
    restore: RestoreReport | None = None  # how a local model's cache began (a prefix state)
    notices: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[TokenDelta]:
        yield from self.generation  # closing this closes the reply's stream

    def stats_dict(self) -> dict[str, Any]:
        return turn_stats_dict(self.generation.stats, self.restore)


def ask_once(
    backend: Backend,
    states: StateStore,
    messages: Sequence[ChatMessage],
    sampling: Sampling | None = None,
    max_tokens: int = 512,
    cancel: threading.Event | None = None,
    tool_use: ToolUse | None = None,
    prefix_min_tokens: int = DEFAULT_MIN_TOKENS,
) -> OneOffTurn:
    """A reply to ``messages`` on the calling thread; ``tool_use``: the tools it is offered.
    ``states`` holds the prefix states, which a prompt head of ``prefix_min_tokens`` or more
    is started from (settings' ``prefix_state_min_tokens``)."""
    if not isinstance(backend, Engine):
        return OneOffTurn(backend.stream(messages, sampling, max_tokens, cancel, tool_use))
    messages = list(messages)
    builder = backend.prompt_builder(tools=list(tool_use.tools) if tool_use else None)
    prompt = builder.build(messages)
    prefix = start_from_prefix(
        backend.cache,
        states,
        backend.state_key,
        prompt.tokens,
        prefix_spans(builder, messages, prompt, len(messages) - 1),
        prefix_min_tokens,
    )
    generation = backend.generate(prompt.tokens, sampling, max_tokens, cancel, tool_use)
    return OneOffTurn(generation, RestoreReport.from_prefix(prefix))
