"""``bench --only window``: turns before and after the conversation outgrows its context;
moving the window (shifting the cache) keeps the later turns as quick as the early ones."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import Progress, filler_text, say, scratch_dir
from localchat.cpu import physical_cores

if TYPE_CHECKING:
    from localchat.conversation.turn import ConversationTurn

WINDOW_CTX = 2048
WINDOW_TURN_WORDS = 80
# Short replies: the figures time the first token, and the reply is cached already when the
# next turn comes, so its length only decides how many turns fill the context (16 instead of
# 48 tokens: more turns measured, in half the time).
WINDOW_REPLY_TOKENS = 16
WINDOW_OVERFLOWS = (
    1.5  # drive the conversation past this many contexts' worth of tokens (8 turns after)
)


@dataclass
class _Turns:
    """What the turns showed, before the window moved and after: each turn's wait for its
    first token, and after, what each evaluated against what was new in it."""

    closing: int  # the tokens that close a message (new in each turn's prompt)
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    evaluated: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    modes: set[str] = field(default_factory=set)
    total: int = 0
    count: int = 0

    def add(self, turn: ConversationTurn) -> bool:
        """Count the turn in; whether it came after the window moved."""
        self.count += 1
        user_start, user_end = turn.prompt.spans[-1]
        self.total += user_end - user_start + turn.stats.generated_tokens
        overflowed = bool(self.after) or turn.window.dropped_messages > 0
        if turn.window.dropped_messages:
            self.modes.add(turn.window.mode)
        if not overflowed:
            self.before.append(turn.resume_ttft_s)
            return False
        self.after.append(turn.resume_ttft_s)
        header = turn.prompt.generation_header
        self.new_tokens.append(self.closing + user_end - user_start + header)
        self.evaluated.append(turn.stats.prompt_tokens_evaluated)
        return True

    def report(self) -> dict[str, Any]:
        pre = statistics.median(self.before)
        post = statistics.median(self.after)
        extra = (e - n for e, n in zip(self.evaluated, self.new_tokens, strict=True))
        return {
            "window_turns": self.count,
            "window_tokens_total": self.total,
            "window_modes": sorted(self.modes),
            "pre_overflow_ttft_s": round(pre, 4),
            "overflow_ttft_s": round(post, 4),
            "overflow_ratio": round(post / pre, 3),
            "overflow_tokens_evaluated": statistics.median(self.evaluated),
            "new_tokens": statistics.median(self.new_tokens),
            # Tokens evaluated beyond the new message's, worst turn after overflow (target 0).
            "overflow_extra_tokens": max(extra),
        }


def bench_window(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Turns before and after the window starts moving: shifting keeps them equally fast."""
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    greedy = Sampling(temperature=0.0)
    with scratch_dir() as data:
        engine = Engine(model_path, LoadOptions(n_ctx=WINDOW_CTX, n_threads=physical_cores()))
        store = Store(data / "conversations.sqlite3")
        conversation = Conversation.open(
            store, StateStore(data / "states"), "window", engine, "You are a helpful assistant."
        )
        turns = _Turns(closing=len(engine.tokenize("<|im_end|>\n", special=True)))
        while turns.total < WINDOW_OVERFLOWS * WINDOW_CTX:
            turn = conversation.send(
                filler_text(turns.count, WINDOW_TURN_WORDS), greedy, WINDOW_REPLY_TOKENS
            )
            for _ in turn:
                pass
            if turns.add(turn) and len(turns.after) % 5 == 1:
                say(progress, f"window: turn {turns.count}, {turns.total} tokens so far,"
                    f" ttft {turns.after[-1]:.3f} s")  # fmt: skip
        conversation.close()
        store.close()
        engine.close()
    return turns.report()
