"""OpenAI's tools through ``localchat serve``: a required call held to the tools' schemas
by a grammar (so even SmolLM2-135M writes a well-formed one), the loop continued from the
tool's result with the history from the cache, each family's format on a generated model
with a real template, and bad tool requests refused in one line."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.tool_stream import ToolCallStream
from localchat.server.app import BackgroundServer
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.state.kvstate import StateStore
from tests.test_serve import NAME, Served, _client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
TEMPLATES = Path(__file__).parent / "templates" / "tools"


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states", parallel=2)
    yield server
    server.close()


def test_a_required_call_then_its_result_continue_from_the_cache(served: Served) -> None:
    client = _client(served.root)
    logged: list = []
    served.models.on_turn = logged.append  # what the request log writes
    cities = {"type": "string", "enum": ["Oslo", "Rome", "Paris"]}  # not left to the build
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": {  # type: ignore[dict-item]
        "type": "object", "properties": {"city": cities}, "required": ["city"]}}}  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(
        model=NAME, messages=messages, tools=[weather], tool_choice="required",  # type: ignore[list-item]
        temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert logged[-1].finish == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Rome", "Paris")  # type: ignore[union-attr]
    # The tool's result goes back; the reply continues with the history from the cache.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": call.function.arguments}}]},  # type: ignore[union-attr]
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "celsius": 21}'},
    ]  # fmt: skip
    second = client.chat.completions.create(
        model=NAME, messages=messages, tools=[weather], temperature=0, max_tokens=40,  # type: ignore[arg-type]
    )  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= first.usage.prompt_tokens  # only the result was read
    # tool_choice "none": the same prompt (its head, and so its cache, kept), no call read.
    same = client.chat.completions.create(
        model=NAME, messages=messages[:1], tools=[weather], tool_choice="none",  # type: ignore[arg-type]
        temperature=0, max_tokens=4,
    )  # fmt: skip
    assert same.usage is not None and same.usage.prompt_tokens == first.usage.prompt_tokens
    assert same.choices[0].message.tool_calls is None


def test_a_named_tool_is_the_one_called_streamed_as_one_delta(served: Served) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Oslo, please."}],
            "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 60, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}  # fmt: skip
    chunks = []
    with httpx.stream("POST", f"{served.root}/v1/chat/completions", json=body,
                      timeout=120) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "get_time"
    assert set(json.loads(calls[0][0]["function"]["arguments"])) == {"zone"}
    assert not any(d.get("content") for d in deltas)  # the call is not shown as text
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_bad_tool_requests_are_one_line_errors(served: Served) -> None:
    def refused(**body: object) -> str:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
        response = httpx.post(f"{served.root}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        return str(response.json()["error"]["message"])

    assert "not among the tools" in refused(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "rm"}}
    )
    assert "tools must be a list" in refused(tools={"a": 1})
    assert "tool_choice must be one of" in refused(tools=[WEATHER], tool_choice="always")
    # A required call whose schema has no grammar: refused before any reply starts, streamed
    # or not, and the request leaves the queue.
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}  # fmt: skip
    for stream in (False, True):
        message = refused(tools=[odd], tool_choice="required", stream=stream)
        assert "cannot be turned into a grammar" in message and "\n" not in message
    counters = served.runner.counters
    assert counters.queued == 0 and counters.running == 0 and served.runner.scheduler.preparing == 0
    assert "required needs tools" in refused(tool_choice="required")
    assert "tool_call_id" in refused(messages=[{"role": "tool", "content": "x"}])
    bad_arguments = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "abc", "type": "function", "function": {"name": "f", "arguments": "{no"}}]}]  # fmt: skip
    assert "arguments is not JSON" in refused(messages=bad_arguments)
    odd_name = {"type": "function", "function": {"name": 'say "hi"', "parameters": {}}}
    assert "must be 1 to 64 letters" in refused(tools=[odd_name])
    unfollowable = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}  # fmt: skip
    assert "cannot be turned into a grammar" in refused(
        tools=[unfollowable], tool_choice="required"
    )


@pytest.mark.parametrize(
    ("template", "marker"), [("qwen3", "<tool_call>"), ("phi-4-mini", "<|tool_call|>")]
)
def test_a_generated_model_with_a_real_template_calls_in_its_format(
    tiny_model: Path, template: str, marker: str
) -> None:
    options = LoadOptions(n_ctx=1024, n_threads=2, template=str(TEMPLATES / f"{template}.jinja"))
    engine = Engine(tiny_model, options)
    runner = ModelRunner(engine, StateStore(Path(tempfile.mkdtemp())), "tiny")
    server = BackgroundServer(Router.of_one(runner))
    try:
        # Random weights would fill a free string to the end: the city is one of two.
        cities = {"type": "string", "enum": ["Oslo", "Rome"]}
        tool = {"type": "function", "function": {**WEATHER["function"], "parameters": {  # type: ignore[dict-item]
            "type": "object", "properties": {"city": cities}, "required": ["city"]}}}  # fmt: skip
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [tool], "tool_choice": "required", "max_tokens": 80,
                "temperature": 0}  # fmt: skip
        reply = httpx.post(f"{server.root}/v1/chat/completions", json=body, timeout=60).json()
        # Streamed: the family's marker never shows as text; the call comes as one delta.
        deltas = []
        with httpx.stream("POST", f"{server.root}/v1/chat/completions",
                          json={**body, "stream": True}, timeout=60) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    finally:
        server.close()
        runner.close()
        engine.close()
    assert engine.template.tool_family in ("hermes", "phi4")
    choice = reply["choices"][0]
    # A random-weight model writes nonsense, but the grammar holds it to one call in the
    # family's frame: parsed back into a call to the tool, arguments after its schema.
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Oslo", "Rome")
    assert not any(marker in (d.get("content") or "") for d in deltas)
    streamed = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed == [call]  # greedy: the same call as unstreamed


def test_a_stream_shows_text_before_a_call_and_holds_back_a_marker_split_across_pieces() -> None:
    stream = ToolCallStream("hermes", {"get_weather"})
    shown = [stream.feed(p) for p in ["Let me check.", " <tool", "_call>\n{\"name\": ",
                                       '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>']]  # fmt: skip
    assert "".join(shown) == "Let me check. "
    rest, calls = stream.finish()
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    plain = ToolCallStream("hermes", {"get_weather"})
    assert plain.feed("No <tool") == "No " and plain.finish() == ("<tool", [])


def test_the_generic_format_streams_prose_and_holds_from_where_json_could_begin() -> None:
    stream = ToolCallStream("generic", {"get_weather"})
    shown = [stream.feed(p) for p in ["Let me look.\n`", "``json\n", '{"name": "get_weather", ',
                                       '"arguments": {"city": "Oslo"}}\n```']]  # fmt: skip
    assert "".join(shown) == "Let me look.\n"
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    prose = ToolCallStream("generic", {"get_weather"})
    assert prose.feed("Sunny, ") + prose.feed("about 20 degrees.") == "Sunny, about 20 degrees."
    code = ToolCallStream("generic", {"get_weather"})
    assert code.feed("Use x = {1: 2}") == "Use x = "
    assert code.finish() == ("{1: 2}", [])  # not a call: shown when the reply ends
