"""A chat on one loaded model: messages in, streamed replies out, the KV cache reused.

The session owns the message list and the token ids each message was evaluated as; the
engine's cache then always holds a prefix of the next prompt, so a turn evaluates only the new
message. Persistence (store, saved KV states) and the context window build on this.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from localchat.engine import Engine, Generation, Sampling, TokenDelta, TurnStats
from localchat.prompt import BuiltPrompt, PromptMessage


@dataclass
class Turn:
    """One exchange in progress: iterate for deltas; the reply is recorded when it ends."""

    session: ChatSession
    user: PromptMessage
    prompt: BuiltPrompt
    generation: Generation
    reply: PromptMessage | None = None

    def __iter__(self) -> Iterator[TokenDelta]:
        try:
            yield from self.generation
        finally:
            self.reply = self.session._record_reply(self)

    @property
    def stats(self) -> TurnStats:
        return self.generation.stats

    @property
    def cancelled(self) -> bool:
        return self.generation.stats.stop_reason == "cancelled"


@dataclass
class ChatSession:
    """Messages of one chat and the engine that answers them."""

    engine: Engine
    system_prompt: str | None = None
    messages: list[PromptMessage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.builder = self.engine.prompt_builder()
        if self.system_prompt:
            self.messages.insert(0, PromptMessage("system", self.system_prompt))

    def send(
        self,
        text: str,
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
    ) -> Turn:
        """Add the user's message and start the reply; iterate the returned turn to stream it."""
        user = PromptMessage("user", text)
        self.messages.append(user)
        try:
            prompt = self.builder.build(self.messages)
            generation = self.engine.generate(prompt.tokens, sampling, max_tokens, cancel)
        except BaseException:
            self.messages.remove(user)
            raise
        return Turn(self, user, prompt, generation)

    def _record_reply(self, turn: Turn) -> PromptMessage:
        history = self.messages[: self.messages.index(turn.user) + 1]
        reply = PromptMessage("assistant", turn.generation.text)
        reply.tokens = self.builder.reply_tokens(
            history, reply, turn.generation.tokens, turn.prompt.generation_header
        )
        self.messages.append(reply)
        return reply
