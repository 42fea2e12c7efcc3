"""``bench --only serve``: ``localchat serve`` on the real SmolLM2, in a process of its own
as clients meet it, read by a plain HTTP client (httpx, the SSE lines parsed, nothing else)
that keeps its connections, as the OpenAI SDK and editors do: a client made per request
spent ~25 ms of its own on each first token (half the short request's), doubled when a
stream beside it had the cores.

- ``serve_gen_ratio``: one stream's tokens/s as the client reads it over the engine's own
  for the same greedy reply in this process (the median of many short pairs, the order
  alternating).
- ``serve_restart_ttft_ratio``: a 2,000-token conversation's next request right after the
  server restarted (its state restored from disk: a restarted server puts its newest states
  back into its sequences before it answers, so the read is part of its start) over the
  same request on a warm server (one that answered the request before it: the same new
  tokens to evaluate), the median ratio of pairs taken side by side; with
  ``serve_reread_ttft_s``, what re-reading the conversation costs.
- ``serve_join_ttft_ratio``: a short request that arrives while another streams a 300-token
  reply, its first-token time over its time alone (it joins the running steps; the median
  of rounds); beside it
  ``serve_join_queued_ttft_s``, the same on a server of one sequence, which answers in turn.
- ``serve_parallel_throughput``: four concurrent streams' tokens/s over one stream's, each
  as its client sees it (tokens over the time from sending to the last token: the prompt's
  turn counts on both sides), the order alternating; the median of rounds.
- ``serve_spec_copy_speedup``: the bench's file returned renamed (``spec``'s copy prompt),
  tokens/s from a server that drafts by prompt lookup (q8_0 cache, flash attention: exact)
  over one that does not, the same greedy text (``serve_spec_identical``); median of rounds.
  Beside it ``serve_spec_copy_possible``, the most any drafting could give on the model now
  (``spec.possible_speedup``).
"""

from __future__ import annotations

import functools
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import Progress, env_with_home, filler_text, say, scratch_dir
from localchat.cpu import physical_cores

if TYPE_CHECKING:
    import httpx

SERVE_CTX = 4096
# A pair (the engine, then the server, or the other way) of 160-token replies swung ±8%
# here, and the median of seven read 0.93-0.97 for one HTTP path: this host's speed moves
# 10-15% within a second. Many short pairs sit closer in time (each ~0.7 s).
GEN_TOKENS = 40
GEN_ROUNDS = 21
JOIN_TOKENS = 300
# The join's ratio is of two first-token times of 50-100 ms: a pair swings by a third.
JOIN_ROUNDS = 5
HISTORY_WORDS = 1900  # with the template: about 2,000 tokens
PARALLEL = 4
PARALLEL_TOKENS = 64
PARALLEL_ROUNDS = 5  # one stream and four, the order alternating
# Restarts (the disk copied back each time) and warm requests in pairs, the median ratio: a
# first token of ~0.15 s swings by a third here, and medians of three each read 0.82-1.41.
RESTART_ROUNDS = 5
QUESTION = "Write a long essay about memory."
SHORT = [{"role": "user", "content": "Say hi."}]
START_LIMIT_S = 120.0
# The server is idle when these read 0 (a missing one is not idle: None).
IDLE_METRICS = ("llamacpp:requests_processing", "localchat:saves_pending")
SPEC_KV = "q8_0"  # flash attention over a quantized cache: a verified run is exact on a CPU
SPEC_TOKENS = 200
SPEC_ROUNDS = 3  # drafting against plain, interleaved


@functools.cache
def http_client() -> httpx.Client:
    """The bench's one HTTP client (thread-safe: the concurrent streams share it)."""
    import httpx

    return httpx.Client(timeout=600)


def wait_server_idle(root: str) -> None:
    """Wait until the server runs no request and writes no state: a reply's state is saved
    in the background after it (megabytes, then fsync), and a request timed meanwhile read
    the disk's share of two cores (a short request's first token 0.07 s instead of 0.02)."""
    from localchat.backends.remote import metric_value  # the client's own Prometheus reader

    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        metrics = http_client().get(f"{root}/metrics").text
        if all(metric_value(metrics, (name,)) == 0 for name in IDLE_METRICS):
            return
        time.sleep(0.02)
    raise RuntimeError("the server stayed busy")


def stream_reply(
    root: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    beside: bool = False,
    model: str | None = None,
) -> dict[str, Any]:
    """One streamed greedy reply read with httpx: its first-token time, its wall time (sent
    to the last content chunk), its tokens/s between the first and the last, the chunks
    read, its token counts (the usage chunk's, with the cached ones), its text and its draft
    counts; to ``model`` where given. It is sent once the server is idle
    (``wait_server_idle``), unless it is meant to run ``beside`` others."""
    if not beside:
        wait_server_idle(root)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if model is not None:
        body["model"] = model
    sent = time.perf_counter()
    first = last = 0.0
    chunks = 0
    prompt_tokens = completion_tokens = cached_tokens = 0
    text: list[str] = []
    timings: dict[str, Any] = {}
    with http_client().stream("POST", f"{root}/v1/chat/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
            completion_tokens = usage.get("completion_tokens", completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            cached_tokens = details.get("cached_tokens", cached_tokens)
            timings = chunk.get("timings") or timings
            choices = chunk.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                text.append(choices[0]["delta"]["content"])
                last = time.perf_counter()
                first = first or last
                chunks += 1
    return {
        "ttft_s": first - sent,
        "wall_s": last - sent,
        "chunks": chunks,
        "tps": (chunks - 1) / max(1e-9, last - first),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "text": "".join(text),
        "draft_n": timings.get("draft_n", 0),
        "draft_n_accepted": timings.get("draft_n_accepted", 0),
    }


def bench_serve(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The server's figures on SmolLM2 (``model_path`` is not used: a real template)."""
    from localchat.models.starter import ensure_starter
    from localchat.paths import app_paths

    starter = ensure_starter(app_paths(), hub=False)
    if not starter.real:
        return {"serve_skipped": f"SmolLM2 could not be had: {starter.note}"}
    with scratch_dir("serve") as scratch:
        results = _gen_and_join(starter.path, scratch / "home", progress)
        results.update(_restart(starter.path, scratch / "restart", progress))
        results.update(_drafting(starter.path, scratch / "spec", progress))
    return results


def _gen_and_join(model: Path, home: Path, progress: Progress) -> dict[str, Any]:
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.bench.common import greedy_turn
    from localchat.chat.template import ChatMessage

    engine = Engine(model, LoadOptions(n_ctx=SERVE_CTX, n_threads=physical_cores()))
    try:
        prompt = engine.prompt_tokens([ChatMessage("user", QUESTION)])
        with ServeProcess(model, home, PARALLEL) as root:
            messages = [{"role": "user", "content": QUESTION}]
            ratios = []
            for index in range(GEN_ROUNDS):
                order = ("engine", "server") if index % 2 == 0 else ("server", "engine")
                tps: dict[str, float] = {}
                for side in order:
                    if side == "engine":
                        wait_server_idle(root)  # the server's last save does not slow the engine
                        tps[side] = greedy_turn(engine, prompt, GEN_TOKENS, cold=index == 0).gen_tps
                    else:  # the server keeps the prompt from the round before: same work
                        tps[side] = stream_reply(root, messages, GEN_TOKENS)["tps"]
                ratios.append(tps["server"] / tps["engine"])
                say(progress, f"serve: round {index + 1}: {tps['server']:.1f} tok/s read over"
                     f" HTTP, {tps['engine']:.1f} in process")  # fmt: skip
            results = {"serve_gen_ratio": round(statistics.median(ratios), 3)}
            results |= _join_and_parallel(root, messages, progress)
        with ServeProcess(model, home, 1) as root:  # one sequence: requests wait their turn
            queued = _join(root, messages)
        say(progress, f"serve: beside a stream on a server of one sequence {queued:.2f} s")
        return results | {"serve_join_queued_ttft_s": round(queued, 3)}
    finally:
        engine.close()


def _drafting(model: Path, home: Path, progress: Progress) -> dict[str, Any]:
    """Copy replies from a drafting server and a plain one, in alternating rounds."""
    from localchat.bench.spec import COPY_PROMPT, possible_speedup

    messages = [{"role": "user", "content": COPY_PROMPT}]
    speeds: dict[str, list[float]] = {"auto": [], "off": []}
    texts: dict[str, set[str]] = {"auto": set(), "off": set()}
    drafted = accepted = context = 0
    with (
        ServeProcess(model, home / "on", 1, ("--kv-type", SPEC_KV, "--speculative", "auto")) as on,
        ServeProcess(model, home / "off", 1, ("--kv-type", SPEC_KV, "--speculative", "off")) as off,
    ):
        roots = {"auto": on, "off": off}
        for index in range(SPEC_ROUNDS):
            for mode in ("auto", "off") if index % 2 == 0 else ("off", "auto"):
                reply = stream_reply(roots[mode], messages, SPEC_TOKENS)
                speeds[mode].append(reply["tps"])
                texts[mode].add(str(reply["text"]))
                if mode == "auto":
                    drafted, accepted = int(reply["draft_n"]), int(reply["draft_n_accepted"])
                    if not reply["prompt_tokens"]:
                        raise RuntimeError("the server sent no usage with the reply")
                    generated = _tokens(reply)
                    context = int(reply["prompt_tokens"]) + generated // 2
        ratio = statistics.median(speeds["auto"]) / statistics.median(speeds["off"])
    say(progress, f"serve: a copy reply drafting {ratio:.2f}x, {accepted} of {drafted} accepted")
    possible = possible_speedup(model, context, SERVE_CTX)
    say(progress, f"serve: drafting could give at most {possible:.2f}x on this model now")
    return {
        "serve_spec_copy_speedup": round(ratio, 3),
        "serve_spec_copy_possible": round(possible, 3),
        "serve_spec_acceptance": round(accepted / max(1, drafted), 3),
        "serve_spec_identical": int(len(texts["auto"] | texts["off"]) == 1),
    }


def _join(root: str, messages: list[dict[str, str]]) -> float:
    """A short request's first-token time while a long reply streams."""
    wait_server_idle(root)
    long_reply = threading.Thread(target=stream_reply, args=(root, messages, JOIN_TOKENS, True))
    long_reply.start()
    time.sleep(0.5)  # the long reply streams
    joined = stream_reply(root, SHORT, 8, beside=True)["ttft_s"]
    long_reply.join()
    return joined


def _join_and_parallel(
    root: str, messages: list[dict[str, str]], progress: Progress
) -> dict[str, Any]:
    alones, joins = [], []
    for _ in range(JOIN_ROUNDS):
        alones.append(stream_reply(root, SHORT, 8)["ttft_s"])
        joins.append(_join(root, messages))
    alone, joined = statistics.median(alones), statistics.median(joins)
    ratio = statistics.median(j / a for j, a in zip(joins, alones, strict=True))
    say(progress, f"serve: a short request alone {alone:.2f} s, beside a stream {joined:.2f} s")
    gains = [_parallel_gain(root, messages, index % 2 == 1) for index in range(PARALLEL_ROUNDS)]
    say(
        progress,
        f"serve: {PARALLEL} streams at once: {statistics.median(gains):.2f}× one's tokens/s",
    )
    return {
        "serve_join_alone_ttft_s": round(alone, 3),
        "serve_join_ttft_s": round(joined, 3),
        "serve_join_ttft_ratio": round(ratio, 2),
        "serve_parallel_throughput": round(statistics.median(gains), 3),
    }


def _tokens(reply: dict[str, Any]) -> int:
    """The reply's tokens: the usage chunk's count, else one a content chunk."""
    return int(reply["completion_tokens"]) or int(reply["chunks"])


def _parallel_gain(root: str, messages: list[dict[str, str]], four_first: bool) -> float:
    """Four concurrent streams' tokens over their wall time, over one stream's alone."""

    def one() -> float:
        reply = stream_reply(root, messages, PARALLEL_TOKENS)
        return _tokens(reply) / reply["wall_s"]

    def four() -> float:
        replies: list[dict[str, Any]] = []
        streams = [
            threading.Thread(
                target=lambda: replies.append(
                    stream_reply(root, messages, PARALLEL_TOKENS, beside=True)
                )
            )
            for _ in range(PARALLEL)
        ]
        wait_server_idle(root)
        began = time.perf_counter()
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.join()
        if len(replies) != PARALLEL:
            raise RuntimeError("a concurrent stream failed")
        return sum(_tokens(r) for r in replies) / (time.perf_counter() - began)

    if four_first:
        together = four()
        return together / one()
    alone = one()
    return four() / alone


def _restart(model: Path, home: Path, progress: Progress) -> dict[str, Any]:
    """A 2,000-token conversation's next request: right after the server restarted (the
    conversation restored from disk), on a warm server that answered the request before it
    (the same new tokens to evaluate), and what re-reading the conversation costs."""
    history = [
        {"role": "system", "content": filler_text(0, HISTORY_WORDS)},
        {"role": "user", "content": "Summarize that in one line."},
    ]
    following = [
        *history,
        {"role": "assistant", "content": "It is about a cache."},
        {"role": "user", "content": "And in three words?"},
    ]
    with ServeProcess(model, home) as root:
        assert stream_reply(root, history, 16)["chunks"] > 0
    saved = home.with_name(f"{home.name}-saved")
    shutil.copytree(home, saved)
    restored_ttfts: list[float] = []
    warms: list[float] = []
    with scratch_dir("serve-cold") as empty, ServeProcess(model, empty) as warm_root:
        reread = stream_reply(warm_root, history, 16)["ttft_s"]
        for index in range(RESTART_ROUNDS):  # in pairs, the order alternating
            for side in ("restart", "warm") if index % 2 == 0 else ("warm", "restart"):
                if side == "warm":
                    stream_reply(warm_root, history, 16)  # it holds the history and another reply
                    warms.append(stream_reply(warm_root, following, 8)["ttft_s"])
                    continue
                wait_server_idle(
                    warm_root
                )  # its last state written: the disk is the restart's alone
                shutil.rmtree(home)  # the disk as the first server left it
                shutil.copytree(saved, home)
                with ServeProcess(model, home) as root:  # a new process: only the disk remembers
                    after_restart = stream_reply(root, following, 8)
                    restored_ttfts.append(after_restart["ttft_s"])
    ratio = statistics.median(r / w for r, w in zip(restored_ttfts, warms, strict=True))
    restored, warm = statistics.median(restored_ttfts), statistics.median(warms)
    say(progress, f"serve: {after_restart['prompt_tokens']} tokens: {restored:.2f} s after a"
         f" restart, {warm:.2f} s warm, {reread:.2f} s re-read")  # fmt: skip
    return {
        "serve_history_tokens": after_restart["prompt_tokens"],
        "serve_restart_ttft_s": round(restored, 3),
        "serve_warm_ttft_s": round(warm, 3),
        "serve_reread_ttft_s": round(reread, 3),
        "serve_restart_ttft_ratio": round(ratio, 3),
    }


class ServeProcess:
    """``localchat serve`` on SmolLM2 in a process of its own (as clients meet it), its
    LOCALCHAT_HOME ``home``; stopped with SIGTERM, which finishes its saves."""

    def __init__(
        self,
        model: Path,
        home: Path,
        parallel: int = 1,
        extra: tuple[str, ...] = (),
        ctx: int = SERVE_CTX,
    ) -> None:
        self.model, self.home, self.parallel, self.extra = model, home, parallel, extra
        self.ctx = ctx

    def __enter__(self) -> str:
        import httpx

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, "-m", "localchat", "serve", "--model-path", str(self.model),
                   "--port", str(port), "--ctx", str(self.ctx),
                   "--parallel", str(self.parallel), *self.extra]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=env_with_home(self.home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        root = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_LIMIT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                    return root
            except httpx.TransportError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("localchat serve did not start")

    def __exit__(self, *_exc: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
