"""``bench --only resume``: the next turn of a 2,000-token conversation, warm in this process
against resumed in a new one (the saved state restored; ``resume_vs_warm``: the median ratio
of pairs taken side by side) and against re-reading it all."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from localchat.bench.common import (
    HISTORY_CTX,
    REPLY_TOKENS,
    Progress,
    _say,
    build_history,
    env_with_home,
    scratch_dir,
)
from localchat.cpu import physical_cores

NEXT_MESSAGE = "Given all of that, what should we do next?"
# One warm turn or one new process swings by ±30% on a busy 2-core machine, and the host's
# speed drifts by as much over minutes: pairs of the two, side by side, the median ratio.
RESUME_ROUNDS = 5


def _ask_in_new_process(home: Path, model_path: Path, *extra: str) -> dict[str, Any]:
    """One turn through the real CLI in a fresh process (model load is not timed in ttft)."""
    command = [
        sys.executable, "-m", "localchat.cli.main", "ask", NEXT_MESSAGE,
        "--model-path", str(model_path), "--conversation", "bench", "--ctx", str(HISTORY_CTX),
        "--temperature", "0", "--max-tokens", str(REPLY_TOKENS), "--json", *extra,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=env_with_home(home), check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"bench turn failed: {result.stderr.strip()}")
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


def bench_resume(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The next turn of a 2,000-token conversation: warm vs resumed in a new process vs fresh."""
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.conversation.local import Conversation
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    greedy = Sampling(temperature=0.0)
    with scratch_dir() as home:
        data = home / "data"
        engine = Engine(model_path, LoadOptions(n_ctx=HISTORY_CTX, n_threads=physical_cores()))
        store = Store(data / "conversations.sqlite3")
        conversation = Conversation.open(store, StateStore(data / "states"), "bench", engine)
        build_history(conversation, progress)
        conversation.wait_saved()
        history_tokens = len(engine.cache.cached_tokens)
        kv_bytes_used = engine.kv_bytes_used
        state_files = list((data / "states").glob("*.lckv"))
        state_bytes = sum(p.stat().st_size for p in state_files)
        backup = home / "backup"
        shutil.copytree(data, backup)

        child_home = home / "child"  # a new process's data: the saved history, each round

        def reset_child() -> None:
            shutil.rmtree(child_home, ignore_errors=True)
            shutil.copytree(backup, child_home / "data")

        history = list(engine.cache.cached_tokens)
        warm_ttfts: list[float] = []
        resumed_runs: list[dict[str, Any]] = []
        for index in range(RESUME_ROUNDS):  # in pairs, the order alternating: drift cancels
            for side in ("warm", "resumed") if index % 2 == 0 else ("resumed", "warm"):
                if side == "warm":  # the same turn again, the cache cut back to the history
                    turn = conversation.send(NEXT_MESSAGE, greedy, REPLY_TOKENS)
                    for _ in turn:
                        pass
                    warm_ttfts.append(turn.resume_ttft_s)
                    warm_reply = turn.generation.text
                    conversation.take_back_last_exchange()
                    engine.cache.hold(history)  # the new message is read again in the next round
                    conversation.wait_saved()  # not written while a new process is timed
                else:
                    reset_child()
                    resumed_runs.append(_ask_in_new_process(child_home, model_path))
        conversation.close()
        store.close()
        engine.close()
        ratios = [
            float(run["stats"]["ttft_s"]) / warm
            for run, warm in zip(resumed_runs, warm_ttfts, strict=True)
        ]
        warm_ttft = statistics.median(warm_ttfts)
        resumed = sorted(resumed_runs, key=lambda r: float(r["stats"]["ttft_s"]))[
            RESUME_ROUNDS // 2
        ]
        _say(progress, f"resume: warm turn {warm_ttft:.3f} s, new process"
             f" {resumed['stats']['ttft_s']:.3f} s (medians)")  # fmt: skip
        reset_child()
        fresh = _ask_in_new_process(child_home, model_path, "--fresh")
        _say(progress, f"resume: --fresh {fresh['stats']['ttft_s']:.3f} s")

    resume_ttft = float(resumed["stats"]["ttft_s"])
    reprefill_ttft = float(fresh["stats"]["ttft_s"])
    state_limit = 1.02 * kv_bytes_used + 64 * 1024
    return {
        "history_tokens": history_tokens,
        "warm_ttft_s": round(warm_ttft, 4),
        "resume_ttft_s": round(resume_ttft, 4),
        "reprefill_ttft_s": round(reprefill_ttft, 4),
        "resume_vs_warm": round(statistics.median(ratios), 3),
        "resume_speedup": round(reprefill_ttft / resume_ttft, 1),
        "resume_restored_from_state": resumed["stats"]["restored_from_state"],
        "restore_s": resumed["stats"]["restore_s"],
        "resume_prompt_tokens_evaluated": resumed["stats"]["prompt_tokens_evaluated"],
        "replies_identical": all(run["reply"] == warm_reply for run in resumed_runs)
        and fresh["reply"] == warm_reply,
        "state_bytes": state_bytes,
        "kv_bytes_used": kv_bytes_used,
        # state_bytes / (1.02 x kv_bytes_used + 64 KiB): the target is <= 1.
        "state_bytes_ratio": round(state_bytes / state_limit, 4),
    }
