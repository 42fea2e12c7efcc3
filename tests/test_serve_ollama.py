"""Ollama's API on ``localchat serve``, through the official ``ollama`` client against a
real uvicorn server on SmolLM2: chat and generate, streamed (NDJSON) and whole, the same
greedy reply as OpenAI's API, a resent conversation read from the cache, the model
listings clients read first, and Ollama's error shape for what is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from localchat.backends.base import Sampling, TurnStats
from localchat.chat.tools import ToolCall
from localchat.server.adapters.ollama import _Reply
from localchat.server.events import Called, Finished, Text
from localchat.server.requests import GenerationRequest
from tests.test_serve import NAME, QUESTION, Served, _client

GREEDY = {"temperature": 0, "num_predict": 30}
GREEDY_SAMPLING = Sampling(temperature=0.0)


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states")
    yield server
    server.close()


def test_chat_is_the_same_reply_as_openais_and_a_resent_chat_reads_the_cache(
    served: Served,
) -> None:
    client = ollama.Client(host=served.root)
    asked = [{"role": "user", "content": QUESTION}]
    whole = client.chat(model="llama3.2:3b", messages=asked, options=GREEDY, stream=False)
    assert whole.model == NAME and whole.done and whole.done_reason == "length"
    assert whole.eval_count == 30 and whole.prompt_eval_count and whole.prompt_eval_count > 10
    assert whole.total_duration and whole.eval_duration and whole.prompt_eval_duration
    same = _client(served.root).chat.completions.create(
        model=NAME,
        messages=asked,
        temperature=0,
        max_tokens=30,  # type: ignore[arg-type]
    )
    text = whole.message.content or ""
    assert text and text == same.choices[0].message.content
    parts = list(client.chat(model=NAME, messages=asked, options=GREEDY, stream=True))
    assert "".join(p.message.content or "" for p in parts) == text
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == 30 and parts[-1].done_reason == "length"
    # The conversation resent with a new message: only the new part is evaluated.
    asked += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    again = client.chat(model=NAME, messages=asked, options=GREEDY)
    assert again.prompt_eval_count is not None and again.prompt_eval_count < 15


def test_generate_templated_raw_and_the_load_probe(served: Served) -> None:
    client = ollama.Client(host=served.root)
    templated = client.generate(model=NAME, prompt=QUESTION, options=GREEDY)
    chat = client.chat(model=NAME, messages=[{"role": "user", "content": QUESTION}],
                       options=GREEDY)  # fmt: skip
    assert templated.response == chat.message.content and templated.done
    streamed = list(client.generate(model=NAME, prompt=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.response or "" for p in streamed) == templated.response
    raw = client.generate(model=NAME, prompt="def add(a, b):", raw=True, options=GREEDY)
    plain = _client(served.root).completions.create(
        model=NAME, prompt="def add(a, b):", max_tokens=30, temperature=0
    )
    assert raw.response == plain.choices[0].text
    loaded = client.generate(model=NAME)  # no prompt: a client asks for the model to load
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_tool_calls_in_ollamas_shape_keep_the_prompt_stable(served: Served) -> None:
    client = ollama.Client(host=served.root)
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "Clear, 21 C."},
    ]  # fmt: skip
    first = client.chat(model=NAME, messages=history, tools=[weather], options=GREEDY)
    second = client.chat(model=NAME, messages=history, tools=[weather], options=GREEDY)
    # The call had no id: the one given it is the same each time, so the prompt is too.
    assert first.prompt_eval_count and first.prompt_eval_count > 30
    assert second.prompt_eval_count == 1 and second.message.content == first.message.content
    # A reply's calls, as the official client reads them.
    request = GenerationRequest(NAME, [], None, GREEDY_SAMPLING, 10)
    reply = _Reply(request, chat=True, started=0.0)
    call = ToolCall("get_weather", {"city": "Oslo"})
    objects = reply.objects(
        [Text("Checking."), Called((call,)), Finished("tool_calls", TurnStats())]
    )
    parsed = [ollama.ChatResponse.model_validate(o) for o in objects]
    calls = parsed[1].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Oslo"}
    assert parsed[2].done and parsed[2].done_reason == "stop"


def test_format_holds_the_reply_to_json(served: Served) -> None:
    client = ollama.Client(host=served.root)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}  # fmt: skip
    reply = client.chat(model=NAME, messages=[{"role": "user", "content": "A city?"}],
                        format=schema, options={"temperature": 0, "num_predict": 60})  # fmt: skip
    assert reply.done_reason == "stop"
    assert set(json.loads(reply.message.content or "")) == {"city"}


def test_what_clients_read_first(served: Served) -> None:
    client = ollama.Client(host=served.root)
    listed = client.list().models
    assert [m.model for m in listed] == [f"{NAME}:latest"]
    assert listed[0].details is not None and listed[0].details.format == "gguf"
    assert listed[0].size and listed[0].size > 50_000_000
    shown = client.show("anything:latest")
    assert shown.modelinfo is not None
    arch = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{arch}.context_length"] == served.runner.batch.n_ctx_seq
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.template and "im_start" in shown.template
    assert shown.details is not None and shown.details.parameter_size == "135M"
    running = client.ps().models
    assert running[0].context_length == served.runner.batch.n_ctx_seq
    assert httpx.get(f"{served.root}/api/version").json()["version"]
    assert httpx.get(f"{served.root}/").text == "Ollama is running"
    props = httpx.get(f"{served.root}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == served.runner.batch.n_ctx_seq
    assert props["total_slots"] == 1 and "im_start" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    meta = httpx.get(f"{served.root}/v1/models").json()["data"][0]["meta"]
    assert meta["n_params"] == shown.modelinfo["general.parameter_count"] and meta["size"]


def test_bad_requests_get_ollamas_error_shape(served: Served) -> None:
    client = ollama.Client(host=served.root)
    hello = [{"role": "user", "content": "hi"}]

    def refused(path: str, **body: object) -> str:
        response = httpx.post(f"{served.root}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert set(response.json()) == {"error"}
        return str(response.json()["error"])

    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model=NAME, messages=hello, options={"mirostat": 2})
    assert raised.value.status_code == 400 and "options.mirostat" in raised.value.error
    assert "messages[0].images[0] is not an image" in refused(
        "/api/chat", model=NAME, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}]
    )
    assert "suffix" in refused("/api/generate", model=NAME, prompt="def f(", suffix="return 1")
    assert "format must be" in refused("/api/chat", model=NAME, messages=hello, format="yaml")
    long = refused("/api/chat", model=NAME, messages=[{"role": "user", "content": "word " * 3000}])
    assert "the prompt is" in long and "context holds" in long
    assert "context holds 8" in refused(
        "/api/chat", model=NAME, messages=hello, options={"num_ctx": 8}
    )
    broken = httpx.post(f"{served.root}/api/chat", content=b"{no",
                        headers={"content-type": "application/json"})  # fmt: skip
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
    missing = httpx.post(f"{served.root}/api/pull", json={"model": "x"})
    assert missing.status_code == 404 and "error" in missing.json()
    # It still answers, with the load-time options a client may send.
    ok = client.chat(model=NAME, messages=hello, options={"num_predict": 2, "num_gpu": 0})
    assert ok.done and served.runner.counters.queued == 0
