"""The remote backend: a real OpenAI-compatible server (llama-cpp-python's own, on a generated
model) for streaming, exactness, conversations, cancel and keys; a stand-in of our own
(tests/sse_server.py) for the faults a real server will not make on demand."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localchat.backends.base import Backend
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.backends.llama.tools import llama_server_command
from localchat.backends.remote import (
    KV_USAGE_METRICS,
    ContextExceeded,
    RemoteBackend,
    RemoteError,
    ServerRefused,
    metric_value,
)
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.conversation.remote import RemoteConversation
from localchat.paths import app_paths
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY
from tests.sse_server import ServerScript, SSEServer

KEY = "sekret-key"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def llama_server(small_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """``python -m llama_cpp.server`` on 127.0.0.1 with the small generated model and a key."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [*llama_server_command(), "--model", str(small_model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024"]
    # Flash attention: a one-token step and a batch give the same logits, so a repeated
    # request (its prompt reused but for one token) answers exactly as the first did.
    command += ["--api_key", KEY, "--n_threads", "2", "--flash_attn", "true"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    headers = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/models", headers=headers, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"llama_cpp.server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    try:
        yield {"url": url, "log": log, "model": str(small_model)}
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCHAT_API_KEY", KEY)


def _stores() -> tuple[Store, StateStore]:
    paths = app_paths()
    return Store(paths.database), StateStore(paths.states_dir)


# -- a real server ----------------------------------------------------------------------
def test_streamed_greedy_reply_equals_the_servers_own_answer(llama_server: dict) -> None:
    backend = RemoteBackend(llama_server["url"], api_key=KEY)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Name three colours.")]
    reply = backend.stream(messages, GREEDY, max_tokens=40)
    deltas = [d.text for d in reply]
    body = {
        "model": backend.model,
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "max_tokens": 40,
        "temperature": 0.0,
        "top_p": GREEDY.top_p,
        "top_k": GREEDY.top_k,
        "min_p": GREEDY.min_p,
        "repeat_penalty": GREEDY.repeat_penalty,
        "seed": GREEDY.seed,
    }
    direct = httpx.post(
        f"{llama_server['url']}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    assert len(deltas) > 5  # it streamed, piece by piece
    assert "".join(deltas) == reply.text == direct["choices"][0]["message"]["content"]
    stats = reply.stats
    assert stats.generated_tokens == len(deltas)
    assert stats.ttft_s > 0 and stats.gen_tps > 0
    assert backend.counts_exactly  # llama-cpp-python's /extras/tokenize counts the messages
    assert stats.counted == "estimated"  # it sends no usage report: tokens are stream events
    assert stats.kv_bytes_used is None  # the cache is the server's
    backend.close()


def test_ask_over_a_server_gives_the_fields_of_a_local_turn(
    llama_server: dict, tiny_model: Path, keyed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--temperature", "0", "--max-tokens", "8", "--json"]
    assert main(["ask", "hi", "--model-path", str(tiny_model), *common]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["ask", "hi", "--server", llama_server["url"], *common]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert remote.keys() == local.keys()
    assert remote["stats"].keys() == local["stats"].keys()
    assert remote["server"] == llama_server["url"] and local["server"] is None
    assert remote["model"] == llama_server["model"]
    assert remote["reply"] and remote["stats"]["generated_tokens"] > 0
    assert remote["stats"]["kv_bytes_used"] is None


def test_a_saved_conversation_continues_on_the_server(
    llama_server: dict, tiny_model: Path, keyed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    store, states = _stores()
    engine = Engine(tiny_model, LoadOptions(n_ctx=512))
    local = Conversation.open(store, states, "trip", engine, "You plan trips.")
    for _ in local.send("Plan a day in Rome.", GREEDY, 12):
        pass
    local.saver.wait()
    local.close()
    engine.close()
    args = ["ask", "And Florence?", "--server", llama_server["url"], "--conversation", "trip"]
    assert main([*args, "--temperature", "0", "--max-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["conversation"] == "trip" and result["reply"]
    record = store.get("trip")
    messages = store.messages(record.id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1].content == result["reply"]
    assert record.model.endswith(f"@ 127.0.0.1:{llama_server['url'].split(':')[2][:-3]}")
    store.close()


def test_cancel_closes_the_stream_and_keeps_the_partial_reply(
    llama_server: dict, keyed: None
) -> None:
    store, states = _stores()
    backend = RemoteBackend(llama_server["url"], api_key=KEY)
    conversation = RemoteConversation.open(store, states, "long", backend)
    cancel = threading.Event()
    turn = conversation.send("Write a long story.", GREEDY, 900, cancel)
    seen = 0
    for delta in turn:
        seen += bool(delta.text)
        if seen == 3:
            cancel.set()
    assert turn.stats.stop_reason == "cancelled"
    assert 3 <= turn.stats.generated_tokens < 900
    assert turn.stats.prompt_tokens_evaluated > 0 and turn.stats.prompt_tps > 0  # figures kept
    stored = store.messages(conversation.record.id)
    assert stored[-1].status == "partial" and stored[-1].content == turn.generation.text
    deadline = time.monotonic() + 10  # the server noticed the client hang up and stopped
    while "disconnected" not in llama_server["log"].read_text().lower():
        assert time.monotonic() < deadline, "the server never saw the stream closed"
        time.sleep(0.1)
    conversation.close()
    backend.close()
    store.close()


def test_the_key_comes_from_the_environment_and_a_refused_one_is_named(
    llama_server: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["ask", "hi", "--server", llama_server["url"], "--max-tokens", "2"]
    monkeypatch.delenv("LOCALCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(args) == 2
    error = capsys.readouterr().err.strip()
    assert "refused the API key (HTTP 401" in error and "LOCALCHAT_API_KEY" in error
    assert len(error.splitlines()) == 1
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # the variable every OpenAI client reads
    assert main(args) == 0
    monkeypatch.setenv("LOCALCHAT_API_KEY", "wrong")  # localchat's own comes first
    assert main(args) == 2


# -- a stand-in server for the faults ---------------------------------------------------
@pytest.fixture
def stand_in() -> Iterator[tuple[SSEServer, ServerScript]]:
    script = ServerScript()
    with SSEServer(script) as server:
        yield server, script


def _turn(server: SSEServer, text: str = "hi", name: str = "c") -> tuple[Store, object]:
    store, states = _stores()
    backend = RemoteBackend(server.url)
    conversation = RemoteConversation.open(store, states, name, backend)
    return store, conversation


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ({"drop_after": 2}, "stream ended before the reply did"),
        ({"malformed_after": 2}, "malformed event ({not json)"),
        ({"error_event_after": 2}, "failed mid-reply (out of memory on the GPU)"),
    ],
)
def test_a_stream_that_breaks_keeps_what_arrived(
    stand_in: tuple[SSEServer, ServerScript], fault: dict, words: str
) -> None:
    server, script = stand_in
    for name, value in fault.items():
        setattr(script, name, value)
    store, conversation = _turn(server)
    assert isinstance(conversation, RemoteConversation)
    turn = conversation.send("hi")
    with pytest.raises(RemoteError) as raised:
        for _ in turn:
            pass
    message = str(raised.value)
    assert words in message and "127.0.0.1" in message and "\n" not in message
    stored = store.messages(conversation.record.id)
    assert [m.role for m in stored] == ["user", "assistant"]  # nothing the user wrote is lost
    assert stored[-1].content == "Hello," and stored[-1].status == "partial"
    conversation.close()
    store.close()


@pytest.mark.parametrize(
    ("script", "code", "words"),
    [
        ({"status": 500}, 1, "failed on the chat request (HTTP 500: the stand-in failed"),
        ({"key": "other"}, 2, "refused the API key (HTTP 401: Invalid API key)"),
    ],
)
def test_refusals_are_one_line_and_the_message_is_handed_back(
    stand_in: tuple[SSEServer, ServerScript],
    capsys: pytest.CaptureFixture[str],
    script: dict,
    code: int,
    words: str,
) -> None:
    server, served = stand_in
    for name, value in script.items():
        setattr(served, name, value)
    assert main(["ask", "hello there", "--server", server.url, "--conversation", "c"]) == code
    error = capsys.readouterr().err.strip()
    assert words in error and len(error.splitlines()) == 1
    served.key = None
    store = Store(app_paths().database)
    record = store.find("c")
    # The turn never started: no half-turn is stored (the CLI's caller still has the text).
    assert record is None or store.messages(record.id) == []
    store.close()


def test_unknown_model_and_unreachable_server(
    stand_in: tuple[SSEServer, ServerScript], capsys: pytest.CaptureFixture[str]
) -> None:
    server, _script = stand_in
    assert main(["ask", "hi", "--server", server.url, "--model", "gpt-9"]) == 2
    assert "has no model 'gpt-9'; it serves stand-in" in capsys.readouterr().err
    assert main(["ask", "hi", "--server", f"http://127.0.0.1:{_free_port()}/v1"]) == 1
    assert "is the server running" in capsys.readouterr().err
    assert main(["ask", "hi", "--server", "gpu-box:8000"]) == 2
    assert "give a URL such as http://gpu-box:8000/v1" in capsys.readouterr().err
    for bad in ("ftp://gpu-box/v1", "http://[::1", "http://gpu-box:abc/v1"):
        assert main(["ask", "hi", "--server", bad]) == 2
        error = capsys.readouterr().err
        assert "not an http(s) address" in error and len(error.strip().splitlines()) == 1


def test_a_key_a_header_cannot_carry_and_the_variable_named(
    stand_in: tuple[SSEServer, ServerScript],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, script = stand_in
    monkeypatch.setenv("LOCALCHAT_API_KEY", "clé")
    assert main(["ask", "hi", "--server", server.url]) == 2
    assert (
        "API key in LOCALCHAT_API_KEY or OPENAI_API_KEY has characters" in capsys.readouterr().err
    )
    monkeypatch.delenv("LOCALCHAT_API_KEY")
    script.key = "right"
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(f'[[servers]]\nname = "box"\nurl = "{server.url}"\nkey_env = "BOX_KEY"\n')
    monkeypatch.setenv("BOX_KEY", "wrong")
    assert main(["ask", "hi", "--server", "box"]) == 2
    error = capsys.readouterr().err
    assert "box refused the API key" in error and "set BOX_KEY to a key" in error


def test_metrics_with_labels_and_timestamps() -> None:
    page = '# TYPE x gauge\nvllm:kv_cache_usage_perc{model_name="a b",engine="0"} 0.5 1700000\n'
    assert metric_value(page, KV_USAGE_METRICS) == 0.5
    assert metric_value("llamacpp:kv_cache_usage_ratio 0.125\n", KV_USAGE_METRICS) == 0.125
    assert metric_value("other 1\n", KV_USAGE_METRICS) is None


def test_a_reply_the_reader_abandons_is_kept_as_partial(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    script.reply = ["one", " two", " three", " four"]
    store, conversation = _turn(server)
    assert isinstance(conversation, RemoteConversation)
    turn = conversation.send("hi")
    deltas = iter(turn)
    next(deltas)
    deltas.close()  # the reader stopped (Ctrl-C in ask lands here too)
    stored = store.messages(conversation.record.id)
    assert stored[-1].status == "partial" and turn.stats.stop_reason == "cancelled"
    conversation.close()
    store.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_escapes_in_remote_text_stay_text(
    stand_in: tuple[SSEServer, ServerScript],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, script = stand_in
    script.reply = ["plain ", "\x1b[31mred\x1b[0m", " \x1b]52;c;aGk=\x07"]
    script.usage = False
    assert main(["ask", "hi", "--server", server.url, "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out  # JSON spells it \u001b
    result = json.loads(out)
    assert result["reply"] == "".join(script.reply)
    assert result["stats"]["tokens_counted_by"] == "estimated"  # no usage report came
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["ask", "hi", "--server", server.url]) == 0
    shown = terminal.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown  # nothing reaches the terminal raw
    assert "\\x1b[31mred" in shown  # made visible instead


def test_a_slow_first_token_can_be_cancelled(stand_in: tuple[SSEServer, ServerScript]) -> None:
    server, script = stand_in
    script.first_token_delay_s = 30.0
    backend = RemoteBackend(server.url)
    cancel = threading.Event()
    reply = backend.stream([ChatMessage("user", "hi")], cancel=cancel)
    threading.Timer(0.3, cancel.set).start()
    assert list(reply) == []  # no text arrived, and the wait ended with the cancel
    assert reply.stats.stop_reason == "cancelled"
    assert script.hung_up.wait(10)  # the connection was closed under the waiting server


def test_context_exceeded_moves_the_window_and_retries_once(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    store, conversation = _turn(server)
    assert isinstance(conversation, RemoteConversation)
    for i in range(6):
        for _ in conversation.send(f"question {i} " + "words " * 40, max_tokens=16):
            pass
    script.context_limit = 300  # the server now holds fewer tokens than the history
    turn = conversation.send("the last question", max_tokens=16)
    for _ in turn:
        pass
    assert turn.window.dropped_messages > 0 and turn.window.mode == "server"
    assert any("left the context window" in n for n in turn.notices)
    sent = script.requests[-1]["messages"]
    assert sent[-1]["content"] == "the last question" and sent[0]["role"] == "user"
    assert sum(len(m["content"]) // 4 + 7 for m in sent) <= 300
    assert len(store.messages(conversation.record.id)) == 14  # the transcript keeps all
    assert conversation.backend.context_size == 300  # learned from the server's words
    script.context_limit = 60  # the newest message alone is too long: its start is cut
    turn = conversation.send("x " * 200, max_tokens=16)
    for _ in turn:
        pass
    assert turn.window.cut_tokens > 0 and any("longer than the context" in n for n in turn.notices)
    assert len(script.requests[-1]["messages"][-1]["content"]) < 400
    script.context_limit = 0  # a server that refuses whatever is sent: one retry, then the error
    before = len(script.requests)
    with pytest.raises(ContextExceeded):
        conversation.send("one more", max_tokens=16)
    assert len(script.requests) == before + 2
    assert len(store.messages(conversation.record.id)) == 16  # the refused message handed back
    conversation.close()
    store.close()


def test_window_planned_with_the_servers_counts_and_context(
    stand_in: tuple[SSEServer, ServerScript],
) -> None:
    server, script = stand_in
    script.models = [{"id": "stand-in", "max_model_len": 400}]  # vLLM lists its context
    script.tokenize = True
    script.tokens_per_event = 2  # the server's usage count is the one reported
    script.metrics = '# HELP x\nllamacpp:kv_cache_usage_ratio{slot="0"} 0.25\n'
    store, conversation = _turn(server)
    assert isinstance(conversation, RemoteConversation)
    assert conversation.backend.context_size == 400 and conversation.backend.counts_exactly is False
    for i in range(8):
        turn = conversation.send(f"question {i} " + "words " * 30, max_tokens=32)
        for _ in turn:
            pass
    assert conversation.backend.counts_exactly is True
    assert turn.window.dropped_messages > 0  # moved before sending: the server never refused
    assert turn.stats.server_kv_usage == 0.25
    assert turn.stats.counted == "server" and turn.stats.generated_tokens == 8
    sent = script.requests[-1]
    prompt = sum(len(m["content"]) // 4 + 7 for m in sent["messages"])
    assert sent["max_tokens"] <= 400 - prompt + 8  # the reply's room fits the context
    conversation.close()
    store.close()


def test_servers_by_name_from_settings(
    stand_in: tuple[SSEServer, ServerScript],
    isolated_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, script = stand_in
    script.key = "box-key"
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(f'[[servers]]\nname = "box"\nurl = "{server.url}"\nkey_env = "BOX_KEY"\n')
    monkeypatch.setenv("BOX_KEY", "box-key")
    assert main(["ask", "hi", "--server", "box", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reply"] == "Hello, world."
    assert main(["ask", "hi", "--server", "boxx"]) == 2
    assert "no server named 'boxx' in settings.toml (box)" in capsys.readouterr().err


def test_refused_before_anything_is_sent(stand_in: tuple[SSEServer, ServerScript]) -> None:
    server, script = stand_in
    script.key = "other"
    with pytest.raises(ServerRefused):
        RemoteBackend(server.url)
    assert script.requests == []


def test_both_backends_answer_the_same_protocol(
    stand_in: tuple[SSEServer, ServerScript], tiny_model: Path
) -> None:
    server, _script = stand_in
    remote = RemoteBackend(server.url)
    local = Engine(tiny_model, LoadOptions(n_ctx=256))
    messages = [ChatMessage("user", "hi")]
    for backend in (remote, local):
        assert isinstance(backend, Backend)
        assert backend.count_tokens("hello world") > 0 and backend.model_name
        assert backend.frees_with_process == (backend is local)  # a quitting app closes a client
        reply = backend.stream(messages, GREEDY, 4)
        assert "".join(d.text for d in reply) == reply.text and reply.stats.generated_tokens > 0
        backend.close()
