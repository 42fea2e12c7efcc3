"""``localchat bench --only remote``: what localchat's client costs on a server's stream.

It starts llama-cpp-python's OpenAI-compatible server on the bench model (127.0.0.1, a free
port), then reads the same greedy reply (the same request body; the two replies must be as
long) through localchat's remote backend and through a bare client (httpx + httpx-sse,
counting events and nothing else), alternating which goes first. ``remote_gen_ratio`` is localchat's tokens/s over the bare client's (medians);
``remote_ttft_overhead_s`` the difference in time to the first token.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import httpx_sse

from localchat.backends.base import Sampling
from localchat.backends.llama.tools import llama_server_command
from localchat.backends.remote import RemoteBackend, stream_body
from localchat.chat.template import ChatMessage

REMOTE_CTX = 2048
REMOTE_TOKENS = 48  # 47 gaps between tokens: the rate holds to a percent
# The server's own speed drifts ±7% between requests, but each round times localchat and the
# bare client back to back: their ratios agree within 2% mostly, yet two runs in seven had
# three rounds of five at 0.93 (the host slow that hour): the median of seven.
REMOTE_ROUNDS = 7
START_LIMIT_S = 120.0
MESSAGES = [ChatMessage("user", "Write a long essay about memory.")]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [*llama_server_command(), "--model", str(model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(REMOTE_CTX)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"llama_cpp.server did not start: {log.read_text()[-500:]}")


def _bare_turn(url: str, model: str) -> tuple[float, float, int]:
    """(TTFT, tokens/s, tokens) read with nothing but the wire and a JSON parse: one token per
    content event. The request is localchat's own (``stream_body``): the bare client left
    the repeat penalty out, llama-cpp-python's server used its 1.1 and wrote another reply,
    and the two replies' speeds differed by 9-15% with no client in it (0.91-0.93)."""
    body = stream_body(model, MESSAGES, Sampling(temperature=0.0), REMOTE_TOKENS)
    with httpx.Client(timeout=600) as client:
        sent = time.perf_counter()
        first = last = 0.0
        tokens = 0
        with httpx_sse.connect_sse(client, "POST", f"{url}/chat/completions", json=body) as source:
            for event in source.iter_sse():
                if event.data.strip() == "[DONE]":
                    break
                choices = json.loads(event.data).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    tokens += 1
    return first - sent, (tokens - 1) / (last - first), tokens


def _localchat_turn(backend: RemoteBackend) -> tuple[float, float, int]:
    reply = backend.stream(MESSAGES, Sampling(temperature=0.0), REMOTE_TOKENS)
    for _ in reply:
        pass
    return reply.stats.ttft_s, reply.stats.gen_tps, reply.stats.generated_tokens


def bench_remote(model: Path, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tokens/s through localchat's remote backend vs a bare client, on a local server."""
    if say:
        say("remote: llama-cpp-python's server on the bench model")
    with tempfile.TemporaryDirectory(prefix="localchat-bench-remote-") as tmp:
        process, url = _start_server(model, Path(tmp) / "server.log")
        try:
            backend = RemoteBackend(url)
            _localchat_turn(backend)  # the server's first turn warms its caches
            ratios, overheads = [], []
            tokens = 0
            for round_index in range(REMOTE_ROUNDS):
                if round_index % 2 == 0:
                    ours = _localchat_turn(backend)
                    bare = _bare_turn(url, backend.model)
                else:
                    bare = _bare_turn(url, backend.model)
                    ours = _localchat_turn(backend)
                tokens = ours[2]
                if ours[2] != bare[2]:  # another reply: its speed says nothing of the client
                    raise RuntimeError(f"the two clients got different replies ({ours[2]} and"
                                       f" {bare[2]} tokens): the requests differ")  # fmt: skip
                ratios.append(ours[1] / bare[1])
                overheads.append(ours[0] - bare[0])
                if say:
                    say(f"remote: round {round_index + 1}: localchat {ours[1]:.1f} tok/s,"
                        f" bare {bare[1]:.1f} tok/s")  # fmt: skip
            backend.close()
        finally:
            process.terminate()
            process.wait(10)
    return {
        "remote_tokens": tokens,
        "remote_gen_ratio": round(statistics.median(ratios), 4),
        "remote_ttft_overhead_s": round(statistics.median(overheads), 4),
    }
