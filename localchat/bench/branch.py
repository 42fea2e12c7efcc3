"""``bench --only branch``: editing question 11 of a 20-turn conversation reads only what
follows the edit, and the edited branch answers as it would read from nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localchat.bench.common import (
    HISTORY_CTX,
    REPLY_TOKENS,
    Progress,
    filler_text,
    say,
    scratch_dir,
)
from localchat.cpu import physical_cores

BRANCH_TURNS = 20
BRANCH_EDIT_AT = 10  # the 11th question of 20 is edited
BRANCH_TURN_WORDS = 40
BRANCH_EDITED = "Forget that: what would you do differently with the cache?"


def bench_branch(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """Editing question 11 of a 20-turn conversation: the tokens evaluated against the history
    and against what follows the edit, and the edited turn's first token against reading the
    edited branch from nothing, with the two continuations compared (greedy)."""
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    greedy = Sampling(temperature=0.0)
    with scratch_dir() as tmp:
        engine = Engine(model_path, LoadOptions(n_ctx=HISTORY_CTX, n_threads=physical_cores()))
        store = Store(tmp / "db.sqlite3")
        conversation = Conversation.open(store, StateStore(tmp / "states"), "b", engine)
        for turn_no in range(BRANCH_TURNS):
            text = filler_text(turn_no, BRANCH_TURN_WORDS)
            for _ in conversation.send(text, greedy, REPLY_TOKENS):
                pass
        history = len(engine.cache.cached_tokens)
        say(progress, f"branch: a {BRANCH_TURNS}-turn conversation of {history} tokens")
        edit_at = 2 * BRANCH_EDIT_AT
        conversation.branch_before(conversation.exchanges[edit_at].record.id)
        turn = conversation.send(BRANCH_EDITED, greedy, REPLY_TOKENS)
        for _ in turn:
            pass
        stats = turn.stats_dict()
        from_edit = stats["prompt_tokens"] - turn.prompt.spans[edit_at][0]
        conversation.wait_saved()
        conversation.close()
        store.close()
        engine.cache.reset()
        fresh = engine.generate(turn.prompt.tokens, greedy, REPLY_TOKENS)
        fresh_text = "".join(delta.text for delta in fresh)
        fresh_ttft = fresh.stats.ttft_s
        engine.close()
    evaluated = stats["prompt_tokens_evaluated"]
    return {
        "edit_history_tokens": history,
        "edit_tokens_evaluated": evaluated,
        "edit_tokens_from_edit": from_edit,
        "edit_extra_tokens": evaluated - from_edit,
        "edit_ttft_s": round(stats["ttft_s"], 4),
        "edit_fresh_ttft_s": round(fresh_ttft, 4),
        "edit_speedup": round(fresh_ttft / max(stats["ttft_s"], 1e-9), 1),
        "edit_replies_identical": fresh_text == turn.generation.text,
    }
