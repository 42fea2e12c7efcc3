"""``bench --only window``: turns before and after the conversation outgrows its context;
moving the window (shifting the cache) keeps the later turns as quick as the early ones."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, filler_text, say, scratch_dir
from localchat.cpu import physical_cores

WINDOW_CTX = 2048
WINDOW_TURN_WORDS = 80
# Short replies: the figures time the first token, and the reply is cached already when the
# next turn comes, so its length only decides how many turns fill the context (16 instead of
# 48 tokens: more turns measured, in half the time).
WINDOW_REPLY_TOKENS = 16
WINDOW_OVERFLOWS = (
    1.5  # drive the conversation past this many contexts' worth of tokens (8 turns after)
)


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
        closing = len(engine.tokenize("<|im_end|>\n", special=True))
        before: list[float] = []
        after: list[float] = []
        evaluated: list[int] = []
        new_tokens: list[int] = []
        modes: set[str] = set()
        total = turn_no = 0
        while total < WINDOW_OVERFLOWS * WINDOW_CTX:
            turn = conversation.send(
                filler_text(turn_no, WINDOW_TURN_WORDS), greedy, WINDOW_REPLY_TOKENS
            )
            for _ in turn:
                pass
            turn_no += 1
            user_start, user_end = turn.prompt.spans[-1]
            total += user_end - user_start + turn.stats.generated_tokens
            overflowed = bool(after) or turn.window.dropped_messages > 0
            if turn.window.dropped_messages:
                modes.add(turn.window.mode)
            if not overflowed:
                before.append(turn.resume_ttft_s)
                continue
            after.append(turn.resume_ttft_s)
            header = turn.prompt.generation_header
            new_tokens.append(closing + user_end - user_start + header)
            evaluated.append(turn.stats.prompt_tokens_evaluated)
            if len(after) % 5 == 1:
                say(
                    progress,
                    f"window: turn {turn_no}, {total} tokens so far, ttft {after[-1]:.3f} s",
                )
        conversation.close()
        store.close()
        engine.close()
    pre = statistics.median(before)
    post = statistics.median(after)
    return {
        "window_turns": turn_no,
        "window_tokens_total": total,
        "window_modes": sorted(modes),
        "pre_overflow_ttft_s": round(pre, 4),
        "overflow_ttft_s": round(post, 4),
        "overflow_ratio": round(post / pre, 3),
        "overflow_tokens_evaluated": statistics.median(evaluated),
        "new_tokens": statistics.median(new_tokens),
        # Tokens evaluated beyond the new message's, worst turn after overflow (target 0).
        "overflow_extra_tokens": max(e - n for e, n in zip(evaluated, new_tokens, strict=True)),
    }
