"""``localchat serve`` through real clients: the official ``openai`` client, plain HTTP and
localchat's own remote backend, against a real uvicorn server on SmolLM2 — replies equal
``ask``'s, a resent conversation reuses the cache, a restarted server restores it from disk,
and every bad request is an OpenAI-shaped error with its status."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from localchat.backends.base import Sampling
from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.backends.remote import RemoteBackend
from localchat.bench.common import filler_text
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.errors import UsageError
from localchat.paths import app_paths
from localchat.server.app import BackgroundServer
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.server.wire import MAX_BODY_BYTES
from localchat.settings import load_settings
from localchat.state.kvstate import StateStore

NAME = "smollm2"
QUESTION = "Write a Python function that returns the squares of a list of numbers."


class Served:
    """SmolLM2 (q8_0 cache: replies exactly ``ask``'s) behind a real uvicorn server."""

    def __init__(
        self,
        model: Path,
        states: Path,
        api_key: str | None = None,
        parallel: int = 1,
        restore: bool = False,
        aliases: tuple[str, ...] = (),
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        options = LoadOptions(n_ctx=2048, n_threads=2, kv_type="q8_0")
        self.engine = Engine(model, options)
        self.runner = ModelRunner(
            self.engine, StateStore(states), NAME, parallel=parallel, aliases=aliases
        )
        self.restored = self.runner.restore_newest() if restore else 0  # as `serve` does
        self.models = Router.of_one(self.runner)
        self.server = BackgroundServer(self.models, api_key, cors_origins)
        self.root = self.server.root

    def close(self) -> None:
        self.server.close()
        self.runner.close()
        self.engine.close()


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states")
    yield server
    server.close()


def _client(root: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0)


def _plain_reply(model: Path, messages: list[ChatMessage], max_tokens: int) -> str:
    """What ``ask`` writes for the same messages: the engine alone, greedy."""
    engine = Engine(model, LoadOptions(n_ctx=2048, n_threads=2, kv_type="q8_0"))
    try:
        generation = engine.generate(
            engine.prompt_tokens(messages), Sampling(temperature=0.0), max_tokens
        )
        for _ in generation:
            pass
        return generation.text
    finally:
        engine.close()


def test_a_reply_over_the_api_is_asks_and_a_resent_conversation_reuses_the_cache(
    served: Served, smollm2: Path
) -> None:
    client = _client(served.root)
    messages: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=NAME,
        messages=messages,
        temperature=0,
        max_tokens=60,  # type: ignore[arg-type]
    )
    text = first.choices[0].message.content or ""
    assert text == _plain_reply(smollm2, [ChatMessage("user", QUESTION)], 60)
    assert first.usage is not None and first.usage.completion_tokens == 60
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].finish_reason == "length"
    # Streamed, with the conversation resent and a new message: the same text as unstreamed,
    # and the earlier prompt and reply come from the cache.
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_tokens=30,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 50
    history = [ChatMessage(m["role"], m["content"]) for m in messages]
    assert streamed == _plain_reply(smollm2, history, 30)
    served.runner.saver.wait()
    metrics = httpx.get(f"{served.root}/metrics").text
    assert (
        "llamacpp:kv_cache_usage_ratio" in metrics
        and "llamacpp:tokens_predicted_total 90" in metrics
        and "localchat:saves_pending 0" in metrics
    )


def test_a_restarted_server_restores_a_resent_conversation_from_disk(
    smollm2: Path, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    first = Served(smollm2, tmp_path / "states")
    try:
        reply = _client(first.root).chat.completions.create(
            model=NAME,
            messages=messages,
            temperature=0,
            max_tokens=40,  # type: ignore[arg-type]
        )
    finally:
        first.close()  # the saves under way finish before it is gone
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "Now as a list comprehension."},
    ]
    again = Served(smollm2, tmp_path / "states")
    try:
        assert len(again.runner.cache) == 1  # found on disk at start
        body = {"model": NAME, "messages": messages, "temperature": 0, "max_tokens": 30}
        answer = httpx.post(f"{again.root}/v1/chat/completions", json=body, timeout=120).json()
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 64 and answer["timings"]["cache_n"] == cached
        assert answer["timings"]["prompt_n"] == answer["usage"]["prompt_tokens"] - cached
        assert (
            "localchat:prompt_tokens_restored_total 0"
            not in httpx.get(f"{again.root}/metrics").text
        )
        history = [ChatMessage(m["role"], m["content"]) for m in messages]
        assert answer["choices"][0]["message"]["content"] == _plain_reply(smollm2, history, 30)
        # The conversation's state now extends the one it was restored from: stored once.
        again.runner.saver.wait()
        assert len(again.runner.cache) == 1
        assert len(list((tmp_path / "states").glob("serve-*"))) == 1
        before_stop = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    finally:
        again.close()  # its sequence's tail, less than a block past the state, saved too
    assert len(list((tmp_path / "states").glob("serve-*"))) == 1
    # As `serve` starts: the state saved last is back in a sequence before the first request,
    # which continues it from memory (nothing read from disk then), with the same text.
    messages += [
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Shorter."},
    ]
    third = Served(smollm2, tmp_path / "states", restore=True)
    try:
        assert third.restored == 1
        body = {"model": NAME, "messages": messages, "temperature": 0, "max_tokens": 20}
        answer = httpx.post(f"{third.root}/v1/chat/completions", json=body, timeout=120).json()
        # All the stopped server held (its last reply too), not just its last whole block.
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= before_stop - 2  # the reply's end token, rendered again by the template
        assert "localchat:prompt_tokens_restored_total 0" in httpx.get(f"{third.root}/metrics").text
        history = [ChatMessage(m["role"], m["content"]) for m in messages]
        assert answer["choices"][0]["message"]["content"] == _plain_reply(smollm2, history, 20)
    finally:
        third.close()


def _error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    return response.status_code, body["error"]["message"]


def test_bad_requests_are_openai_shaped_errors(served: Served) -> None:
    url = f"{served.root}/v1/chat/completions"
    hello = [{"role": "user", "content": "hi"}]
    assert _error(httpx.post(url, content=b"{not json"))[0] == 400
    status, message = _error(httpx.post(url, json={"messages": hello, "n": 17}))
    assert status == 400 and "n must be at most 16" in message
    status, message = _error(httpx.post(url, json={"messages": "hi"}))
    assert status == 400 and "messages must be a non-empty list" in message
    status, message = _error(httpx.post(url, json={"messages": hello, "temperature": "hot"}))
    assert status == 400 and "temperature must be a number" in message
    # A name this server does not know is answered by its model, which the reply names.
    other = httpx.post(url, json={"model": "gpt-4o", "messages": hello, "max_tokens": 2},
                       timeout=60)  # fmt: skip
    assert other.status_code == 200 and other.json()["model"] == NAME
    status, message = _error(httpx.post(url, json={"messages": hello, "max_tokens": 5000}))
    assert status == 400 and "max_tokens 5000 is past the context" in message
    status, _ = _error(httpx.post(url, content=b"x" * (MAX_BODY_BYTES + 1)))
    assert status == 413
    # The model still answers after all of that.
    ok = httpx.post(url, json={"messages": hello, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["model"] == NAME


def test_without_a_key_browsers_and_other_host_names_are_refused(served: Served) -> None:
    url = f"{served.root}/v1/chat/completions"
    form = httpx.post(url, content=b'{"messages": []}', headers={"content-type": "text/plain"})
    assert _error(form) == (
        415,
        "send the body as application/json (Content-Type: application/json)",
    )
    rebound = httpx.get(f"{served.root}/v1/models", headers={"host": "evil.example:8080"})
    status, message = _error(rebound)
    assert status == 403 and "not for host 'evil.example'" in message
    assert _error(httpx.get(f"{served.root}/v2/nothing"))[0] == 404
    seeded = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": -1}
    assert httpx.post(url, json=seeded, timeout=60).status_code == 200


def test_an_api_key_guards_everything_but_health(smollm2: Path, tmp_path: Path) -> None:
    server = Served(smollm2, tmp_path / "states", api_key="s3cret")
    try:
        assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
        status, message = _error(httpx.get(f"{server.root}/v1/models"))
        assert status == 401 and "API key" in message
        with pytest.raises(openai.AuthenticationError):
            _client(server.root, "wrong").models.list()
        assert [m.id for m in _client(server.root, "s3cret").models.list()] == [NAME]
    finally:
        server.close()


def test_tokenize_detokenize_completions_and_localchats_own_client(served: Served) -> None:
    tokens = httpx.post(f"{served.root}/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert tokens == served.engine.tokenize("Hello world", special=True)
    text = httpx.post(f"{served.root}/detokenize", json={"tokens": tokens}).json()["content"]
    assert text == "Hello world"
    assert _error(httpx.post(f"{served.root}/detokenize", json={"tokens": [-1]}))[0] == 400
    done = _client(served.root).completions.create(
        model=NAME, prompt="def add(a, b):", max_tokens=12, temperature=0
    )
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 12
    # localchat itself as the client: counts from /tokenize, the cache fill from /metrics.
    remote = RemoteBackend(f"{served.root}/v1", NAME)
    try:
        reply = remote.stream([ChatMessage("user", "Say hi.")], Sampling(temperature=0.0), 8)
        said = "".join(delta.text for delta in reply)
        assert said and reply.stats.generated_tokens == 8
        assert remote.count_tokens("Hello world") == len(tokens)
        usage = remote.cache_usage()
        assert usage is not None and 0 < usage < 1
    finally:
        remote.close()


def test_a_client_that_leaves_mid_stream_stops_its_sequence(served: Served) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{served.root}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 30
    while served.runner.counters.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.runner.counters.running == 0
    assert 0 < served.runner.counters.generated_tokens < 100  # stopped at once, not at 1000
    # What was generated stays in the cache.
    assert len(served.runner.batch.tokens[0]) > 20


def test_serve_binds_other_addresses_only_with_a_key(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--host", "0.0.0.0", "--model-path", "x.gguf"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 lets other machines use the model: give --api-key KEY" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_cli_serves_and_stops_on_a_signal_after_its_saves(
    smollm2: Path, isolated_home: Path, stop: signal.Signals, code: int
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "localchat", "serve", "--model-path", str(smollm2),
               "--ctx", "1024"]  # fmt: skip
    if stop == signal.SIGINT:
        command += ["--port", str(port), "--parallel", "1"]
    else:  # a service: its address and JSON lines from settings.toml's [serve]
        app_paths().settings_file.parent.mkdir(parents=True, exist_ok=True)
        app_paths().settings_file.write_text(
            f'[serve]\nport = {port}\nlog_format = "json"\nparallel = 2\n'
        )
    process = subprocess.Popen(
        command, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        sequences = "1 sequence" if stop == signal.SIGINT else "2 sequences"
        assert (
            f"serving SmolLM2-135M-Instruct Q4_1 (context 1024 × {sequences}) at"
            f" http://127.0.0.1:{port}/v1" in banner
        )
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        listed = [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]]
        # The file's stem, the name it was served under before, is still answered.
        assert listed == ["SmolLM2-135M-Instruct Q4_1"]
        body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 80,
                "model": "SmolLM2-135M-Instruct.Q4_1"}  # fmt: skip
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert answer.json()["usage"]["completion_tokens"] > 0
        assert answer.json()["model"] == "SmolLM2-135M-Instruct.Q4_1"
        if stop == signal.SIGINT:  # Ctrl+C under a streaming reply: its client is told why
            body |= {"max_tokens": 600, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                              json=body, timeout=120) as reply:  # fmt: skip
                events = reply.iter_lines()
                while '"content"' not in next(events):
                    pass
                process.send_signal(stop)
                data = [line for line in events if line.startswith("data: {")]
            error = json.loads(data[-1][6:])["error"]
            assert error["message"] == "the server was stopped (Ctrl+C) before the reply ended"
    finally:
        process.send_signal(stop)
        exited = process.wait(timeout=30)
    err = process.stderr.read() if process.stderr else ""
    assert exited == code, err
    assert list(app_paths().states_dir.glob("serve-*")), "the reply's state was saved first"
    lines = [line for line in err.splitlines() if line.startswith("{")]
    if stop == signal.SIGTERM:  # one JSON object per request
        record = json.loads(lines[0])
        assert record["endpoint"] == "chat" and record["completion_tokens"] > 0
    else:  # not a terminal: a line per request
        assert "chat: " in err and "generated at" in err and not lines


def test_serve_settings_are_checked_in_one_line(tmp_path: Path) -> None:
    settings = tmp_path / "settings.toml"
    settings.write_text('[serve]\nhost = "0.0.0.0"\nport = 9000\napi_key_env = "MY_KEY"\n')
    config = load_settings(settings).serve
    assert (config.host, config.port, config.api_key_env, config.log_format) == (
        "0.0.0.0", 9000, "MY_KEY", "text",
    )  # fmt: skip
    for text, said in (
        ("[serve]\nport = 70000\n", "port 1 to 65535"),
        ('[serve]\nlog_format = "xml"\n', "log_format must be one of text, json, not 'xml'"),
        ('[serve]\nkey = "s3cret"\n', "[serve] has no key; known: api_key_env, ctx, host"),
    ):
        settings.write_text(text)
        with pytest.raises(UsageError, match=re.escape(said)):
            load_settings(settings)


def test_the_prompt_cache_serves_states_before_they_are_on_disk_and_stores_a_chain_once(
    tmp_path: Path,
) -> None:
    from localchat.server.prompt_cache import BLOCK, PromptCache
    from localchat.state.kvstate import BackgroundSaver, StateKey

    key = StateKey("f" * 64, 2048, "q8_0", "test")
    states = StateStore(tmp_path / "states")
    saver = BackgroundSaver(states)
    cache = PromptCache(states, key, saver)
    first = list(range(3 * BLOCK + 5))
    sid = cache.save(first, b"first")
    hit = cache.lookup([*first, 9, 9])  # queued or written: found either way
    assert hit is not None and hit.state_id == sid and hit.shared == len(first)
    assert cache.lookup([*first[:BLOCK], 7, 7, 7]) is None or len(first) >= BLOCK
    longer = [*first, *range(1000, 1000 + 2 * BLOCK)]
    cache.save(longer, b"second", replaces=sid)
    saver.wait()
    assert len(list((tmp_path / "states").glob("serve-*"))) == 1  # the chain, stored once
    hit = cache.lookup([*longer, 5])
    assert hit is not None and bytes(hit.state.payload) == b"second"
    # Nothing shared beyond what the caller already holds: no read at all.
    assert cache.lookup([*longer, 5], beyond=len(longer)) is None
    # Another model's index never sees it; a restarted one does; a damaged file is skipped.
    assert len(PromptCache(states, StateKey("e" * 64, 2048, "q8_0", "test"), saver)) == 0
    (tmp_path / "states" / f"serve-broken.{'f' * 16}.lckv").write_bytes(b"LCKVSTAT\x02")
    again = PromptCache(states, key, saver)
    assert len(again) == 1 and again.lookup([*longer, 5]) is not None
    # A state the budget evicted is forgotten when asked for.
    for path in (tmp_path / "states").glob("serve-*.lckv"):
        path.unlink()
    assert again.lookup([*longer, 5]) is None and len(again) == 0
    saver.close()


def test_a_terminal_shows_one_status_line_redrawn_in_place(served: Served) -> None:
    from localchat.server.live import REDRAW_S, ServerLog

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    log = ServerLog(served.models, terminal)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    httpx.post(f"{served.root}/v1/chat/completions", json=body, timeout=60)
    time.sleep(2.5 * REDRAW_S)
    log.close()
    shown = terminal.getvalue()
    assert shown.startswith(f"\r\x1b[2K{NAME}: running 0/1 · waiting 0 · last ")
    assert "KV " in shown and "evaluated · 0 saved states" in shown  # under a block: none
    assert "\n" not in shown.rstrip("\n")  # redrawn in place, not scrolled


@contextlib.contextmanager
def holding_compute(limit_s: float = 120) -> Iterator[None]:
    """The compute thread held busy (as by a long reply) until the block ends."""
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(limit_s)

    holder = threading.Thread(target=run_compute, args=(hold,))
    holder.start()
    assert busy.wait(60)
    try:
        yield
    finally:
        release.set()
        holder.join()


def test_counting_tokens_does_not_wait_for_the_compute_thread(served: Served) -> None:
    # The compute thread is held (as by a long reply): without the fix the count times out.
    with holding_compute(60):
        counted = httpx.post(f"{served.root}/tokenize", json={"content": "Hello world"},
                             timeout=20).json()  # fmt: skip
        text = httpx.post(f"{served.root}/detokenize", json={"tokens": counted["tokens"]},
                          timeout=20).json()  # fmt: skip
    assert counted["tokens"] == served.engine.tokenize("Hello world", special=True)
    assert text["content"].endswith("Hello world")


async def test_a_streams_pieces_go_out_in_batches_and_its_end_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first piece wakes the loop; pieces that come while it paces wait for the next
    batch, and the end cuts the pacing short (an hour here: the test would hang)."""
    import asyncio

    from localchat.backends.base import TurnStats
    from localchat.server import turns
    from localchat.server.events import Finished, Text

    monkeypatch.setattr(turns, "STREAM_INTERVAL_S", 3600.0)
    pieces = turns._Batches(asyncio.get_running_loop())
    threading.Thread(target=pieces.put, args=(Text("a"),)).start()
    batches = pieces.batches()
    first = await asyncio.wait_for(anext(batches), 30)
    end = Finished("stop", TurnStats())

    def rest() -> None:
        for piece in ("b", "c"):
            pieces.put(Text(piece))
        pieces.put(end)

    await asyncio.get_running_loop().run_in_executor(None, rest)
    second = await asyncio.wait_for(anext(batches), 30)
    assert first == [Text("a")]
    assert second == [Text("b"), Text("c"), end]
    assert [batch async for batch in batches] == []


def test_a_resent_reply_in_other_words_still_replaces_its_turns_state(
    served: Served, tmp_path: Path
) -> None:
    """Agents send a tool call back as their template renders it, not as the model wrote
    it: each turn's state must still replace the last one (it holds all the last request
    sent), or a long loop's states fill the disk budget and push out other conversations."""
    client = _client(served.root)
    messages: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
    saved, sent = [], 0
    for turn in range(3):
        reply = client.chat.completions.create(
            model=NAME,
            messages=messages,
            temperature=0,
            max_tokens=40,  # type: ignore[arg-type]
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        # All the earlier turns, less the reply as written, came from the cache.
        assert reply.usage.prompt_tokens_details.cached_tokens >= sent
        sent = reply.usage.prompt_tokens
        served.runner.saver.wait()
        saved.append(len(list((tmp_path / "states").glob("serve-*"))))
        note = f"(turn {turn}: the reply was {reply.choices[0].message.content!r})"
        messages += [
            {"role": "assistant", "content": f"A reply in other words. {note}"},
            {"role": "user", "content": filler_text(turn, 90)},
        ]
    assert saved == [1, 1, 1]


def test_a_state_stopped_inside_its_prompt_is_continued_by_the_retry() -> None:
    """A client that gave up while its long prompt was read retries it whole: the state
    saved from the part that was read is replaced, not left beside the new one."""
    from localchat.server.slots import HeldState

    prompt = list(range(500))
    partial = HeldState("s", prompt[:200], len(prompt))  # stopped after 200 of 500
    assert partial.prompt == 200 and partial.continued_by(prompt)
    whole = HeldState("t", [*prompt, 7, 8, 9], len(prompt))  # the reply as written
    assert whole.continued_by([*prompt, 8, 9, 10]) and not whole.continued_by(prompt[:499])
