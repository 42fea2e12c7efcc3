"""``bench --only zerowait``: what a user waits for at the start of a turn when localchat has
read ahead — a long system prompt restored as a saved prefix, a long conversation restored
on opening, and a long message read while it is typed."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import Progress, build_history, filler_text, say, scratch_dir
from localchat.cpu import physical_cores

if TYPE_CHECKING:
    from localchat.backends.llama.engine import Engine

ZEROWAIT_CTX = 4096
ZEROWAIT_SYSTEM_TOKENS = 1500
# The app opening a long conversation: a ratio within 5% of 1 that one round moves by
# ±12% (0.92-1.14 in eight rounds, median 1.02; 0.98-1.15 over three runs of five): seven.
ZEROWAIT_ROUNDS = 7
# A prefix read cold once (9-17 s: long, steady) against restored this many times (0.25-0.5 s,
# the noisy side): 34-35x, target 20x.
PREFIX_RESTORES = 3
ZEROWAIT_MESSAGE = "Given that guide, how should I name a function?"
# The type-ahead figure: messages of this many words typed in the app, this many times. At a
# typist's 20 characters a second the typing is the cost (the machine idles meanwhile): 48
# words (~75 tokens, half a second to read cold on the 0.5b shape, twice a one-word
# message's wait) is a long message still, typed in a quarter of a minute.
TYPEAHEAD_WORDS = 48
TYPEAHEAD_ROUNDS = 1  # 0.4-0.6x a one-word message against a 1.5x target: one is enough


def _app_resume(engine: Engine, progress: Progress) -> dict[str, Any]:
    """The app's first turn after opening a 2,000-token conversation vs its next (warm) one."""
    from localchat.bench.app.measure import app_resume_vs_warm  # the app's own measurement
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    with scratch_dir() as tmp:
        home = tmp / "home"
        data = home / "data"
        engine.cache.reset()
        store = Store(data / "conversations.sqlite3")
        conversation = Conversation.open(store, StateStore(data / "states"), "long", engine)
        build_history(conversation)
        conversation.wait_saved()
        conversation.close()
        store.close()
        say(
            progress,
            f"zerowait: the app opens a {len(engine.cache.cached_tokens)}-token conversation",
        )
        messages = (filler_text(900, 30), filler_text(901, 30))
        return app_resume_vs_warm(
            engine.model_path, home, "long", messages, engine.n_ctx, ZEROWAIT_ROUNDS
        )


def bench_zerowait(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """A new conversation that opens with a 1,500-token system prompt: its first token when
    the prompt was never seen (cold: read, then saved as a prefix state) vs when an earlier
    conversation saved it (restored), medians over rounds; the replies must be the same."""
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    greedy = Sampling(temperature=0.0)
    engine = Engine(model_path, LoadOptions(n_ctx=ZEROWAIT_CTX, n_threads=physical_cores()))
    words: list[str] = []
    while len(engine.tokenize(" ".join(words))) < ZEROWAIT_SYSTEM_TOKENS:
        words.extend(filler_text(len(words), 50).split())
    system = " ".join(words)
    cold_ttft = 0.0
    warm_ttfts: list[float] = []
    replies: set[str] = set()
    restored = 0
    with scratch_dir() as tmp:
        store = Store(tmp / "db.sqlite3")
        states = StateStore(tmp / "states")
        for index in range(1 + PREFIX_RESTORES):  # read cold, then restored each time
            engine.cache.reset()
            conversation = Conversation.open(store, states, f"chat {index}", engine, system)
            turn = conversation.send(ZEROWAIT_MESSAGE, greedy, 8)
            for _ in turn:
                pass
            conversation.wait_saved()
            conversation.close()
            stats = turn.stats_dict()
            if index == 0:
                cold_ttft = stats["ttft_s"]
            else:
                warm_ttfts.append(stats["ttft_s"])
                restored = stats["restored_prefix_tokens"] or restored
            replies.add(turn.generation.text)
        store.close()
    warm = statistics.median(warm_ttfts)
    say(progress, f"zerowait: a prefix read cold {cold_ttft:.2f} s, restored {warm:.3f} s")
    app = _app_resume(engine, progress)
    engine.close()
    from localchat.bench.app.measure import TYPING_CHARS_PER_S, app_type_ahead

    messages = [filler_text(950 + i, TYPEAHEAD_WORDS) for i in range(TYPEAHEAD_ROUNDS)]
    minutes = sum(len(m) for m in messages) / TYPING_CHARS_PER_S / 60
    say(progress, f"zerowait: typing {TYPEAHEAD_ROUNDS} messages of {TYPEAHEAD_WORDS} words"
         f" into the app at {TYPING_CHARS_PER_S:.0f} characters/s (~{minutes:.1f} min)")  # fmt: skip
    app |= app_type_ahead(model_path, messages, ZEROWAIT_CTX)
    return app | {
        "prefix_restored_tokens": restored,
        "prefix_cold_ttft_s": round(cold_ttft, 4),
        "prefix_ttft_s": round(warm, 4),
        "prefix_speedup": round(cold_ttft / warm, 1),
        "prefix_replies_identical": len(replies) == 1,
    }
