"""``bench --only resume``: the next turn of a 2,000-token conversation, warm in this process
against resumed in a new one (the saved state restored; ``resume_vs_warm``: the median ratio
of pairs taken side by side) and against re-reading it all."""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import (
    HISTORY_CTX,
    REPLY_TOKENS,
    ChildHome,
    Progress,
    ask_in_new_process,
    build_history,
    say,
    scratch_dir,
)
from localchat.cpu import physical_cores

if TYPE_CHECKING:
    from localchat.backends.llama.engine import Engine
    from localchat.conversation.local import Conversation

NEXT_MESSAGE = "Given all of that, what should we do next?"
# One warm turn or one new process swings by ±30% on a busy 2-core machine, and the host's
# speed drifts by as much over minutes: pairs of the two, side by side, the median ratio.
RESUME_ROUNDS = 5


def _ask_in_new_process(home: Path, model_path: Path, *extra: str) -> dict[str, Any]:
    """The next turn through the real CLI in a fresh process."""
    return ask_in_new_process(home, model_path, NEXT_MESSAGE, HISTORY_CTX, *extra)


@dataclass
class _Rounds:
    """The paired rounds: each warm turn's first-token wait, the warm reply, and each new
    process's run (its stats and reply)."""

    warm_ttfts: list[float] = field(default_factory=list)
    warm_reply: str = ""
    resumed_runs: list[dict[str, Any]] = field(default_factory=list)

    def median_resumed(self) -> dict[str, Any]:
        return sorted(self.resumed_runs, key=lambda r: float(r["stats"]["ttft_s"]))[
            RESUME_ROUNDS // 2
        ]


def bench_resume(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The next turn of a 2,000-token conversation: warm vs resumed in a new process vs fresh."""
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    with scratch_dir() as home:
        data = home / "data"
        engine = Engine(model_path, LoadOptions(n_ctx=HISTORY_CTX, n_threads=physical_cores()))
        store = Store(data / "conversations.sqlite3")
        conversation = Conversation.open(store, StateStore(data / "states"), "bench", engine)
        build_history(conversation, progress)
        conversation.wait_saved()
        history_tokens = len(engine.cache.cached_tokens)
        kv_bytes_used = engine.kv_bytes_used
        state_bytes = sum(p.stat().st_size for p in (data / "states").glob("*.lckv"))
        shutil.copytree(data, home / "backup")
        child = ChildHome(home / "backup", home / "child")
        rounds = _paired_rounds(conversation, engine, child, model_path)
        conversation.close()
        store.close()
        engine.close()
        resumed = rounds.median_resumed()
        say(progress, f"resume: warm turn {statistics.median(rounds.warm_ttfts):.3f} s,"
            f" new process {resumed['stats']['ttft_s']:.3f} s (medians)")  # fmt: skip
        child.reset()
        fresh = _ask_in_new_process(child.path, model_path, "--fresh")
        say(progress, f"resume: --fresh {fresh['stats']['ttft_s']:.3f} s")
    return _report(rounds, fresh, history_tokens, kv_bytes_used, state_bytes)


def _paired_rounds(
    conversation: Conversation, engine: Engine, child: ChildHome, model_path: Path
) -> _Rounds:
    """``RESUME_ROUNDS`` pairs of the same next turn, warm here and resumed in a new process,
    the order alternating so that the host's drift cancels."""
    from localchat.backends.base import Sampling

    greedy = Sampling(temperature=0.0)
    history = list(engine.cache.cached_tokens)
    rounds = _Rounds()
    for index in range(RESUME_ROUNDS):
        for side in ("warm", "resumed") if index % 2 == 0 else ("resumed", "warm"):
            if side == "warm":  # the same turn again, the cache cut back to the history
                turn = conversation.send(NEXT_MESSAGE, greedy, REPLY_TOKENS)
                for _ in turn:
                    pass
                rounds.warm_ttfts.append(turn.resume_ttft_s)
                rounds.warm_reply = turn.generation.text
                conversation.take_back_last_exchange()
                engine.cache.hold(history)  # the new message is read again in the next round
                conversation.wait_saved()  # not written while a new process is timed
            else:
                child.reset()
                rounds.resumed_runs.append(_ask_in_new_process(child.path, model_path))
    return rounds


def _report(
    rounds: _Rounds,
    fresh: dict[str, Any],
    history_tokens: int,
    kv_bytes_used: int,
    state_bytes: int,
) -> dict[str, Any]:
    """The bench's figures from the rounds and the fresh run."""
    resumed = rounds.median_resumed()
    ratios = [
        float(run["stats"]["ttft_s"]) / warm
        for run, warm in zip(rounds.resumed_runs, rounds.warm_ttfts, strict=True)
    ]
    resume_ttft = float(resumed["stats"]["ttft_s"])
    reprefill_ttft = float(fresh["stats"]["ttft_s"])
    state_limit = 1.02 * kv_bytes_used + 64 * 1024
    warm_reply = rounds.warm_reply
    return {
        "history_tokens": history_tokens,
        "warm_ttft_s": round(statistics.median(rounds.warm_ttfts), 4),
        "resume_ttft_s": round(resume_ttft, 4),
        "reprefill_ttft_s": round(reprefill_ttft, 4),
        "resume_vs_warm": round(statistics.median(ratios), 3),
        "resume_speedup": round(reprefill_ttft / resume_ttft, 1),
        "resume_restored_from_state": resumed["stats"]["restored_from_state"],
        "restore_s": resumed["stats"]["restore_s"],
        "resume_prompt_tokens_evaluated": resumed["stats"]["prompt_tokens_evaluated"],
        "replies_identical": all(run["reply"] == warm_reply for run in rounds.resumed_runs)
        and fresh["reply"] == warm_reply,
        "state_bytes": state_bytes,
        "kv_bytes_used": kv_bytes_used,
        # state_bytes / (1.02 x kv_bytes_used + 64 KiB): the target is <= 1.
        "state_bytes_ratio": round(state_bytes / state_limit, 4),
    }
