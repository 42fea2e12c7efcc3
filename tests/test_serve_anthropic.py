"""Anthropic's Messages API on ``localchat serve``, through the official ``anthropic``
client against a real uvicorn server on SmolLM2: a greedy reply is the same as through
OpenAI's API (and ``ask``'s), a resent conversation is read from the cache and says so in
``cache_read_input_tokens``, tool calls and their results go round, a reasoning model's
thinking comes as thinking blocks, and every bad request gets Anthropic's error shape."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.template import ChatMessage
from localchat.server.app import BackgroundServer
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.server.wire import MAX_BODY_BYTES
from localchat.state.kvstate import StateStore
from tests.test_serve import NAME, QUESTION, Served, _client, _plain_reply

CITY = {"type": "string", "enum": ["Oslo", "Rome", "Paris"]}  # a grammar's fixed choice
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
}
TEMPLATES = Path(__file__).parent / "templates" / "tools"
# Anthropic's SDK no longer sends sampling settings of its own; the API still takes them.
GREEDY: dict = {"extra_body": {"temperature": 0}}


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states", api_key="s3cret")
    yield server
    server.close()


def _claude(root: str, key: str = "s3cret") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key=key, max_retries=0)


def test_a_greedy_message_is_asks_reply_and_a_resent_conversation_reads_the_cache(
    served: Served, smollm2: Path
) -> None:
    client = _claude(served.root)
    first = client.messages.create(
        model="claude-sonnet-4-5",  # a name it does not know: its own model answers
        max_tokens=40,
        **GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert first.model == NAME and first.id.startswith("msg_")
    text = first.content[0].text  # type: ignore[union-attr]
    assert text == _plain_reply(smollm2, [ChatMessage("user", QUESTION)], 40)
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 40
    assert first.usage.cache_read_input_tokens == 0
    prompt_tokens = first.usage.input_tokens
    # The same through OpenAI's API: one request, one internal path.
    same = _client(served.root, "s3cret").chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], **GREEDY, max_tokens=40
    )
    assert same.choices[0].message.content == text
    # Streamed, the conversation resent with a new message: the history comes from the cache.
    events = []
    with client.messages.stream(
        model=NAME,
        max_tokens=30,
        **GREEDY,
        system=[{"type": "text", "text": "You are terse."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Thanks."},
        ],
    ) as stream:
        for event in stream:
            events.append(event.type)
        message = stream.get_final_message()
    kinds = [e for e in events if not e.startswith(("text", "input_json", "thinking"))]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert message.content[0].type == "text" and message.content[0].text
    unstreamed = client.messages.create(
        model=NAME, max_tokens=30, **GREEDY, system="You are terse.",
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text},
                  {"role": "user", "content": "Thanks."}],
    )  # fmt: skip
    assert unstreamed.content[0].text == message.content[0].text  # type: ignore[union-attr]
    usage = unstreamed.usage
    assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens > 0
    assert usage.input_tokens < 10  # only the last prompt token is read again
    streamed = message.usage
    assert streamed.cache_read_input_tokens is not None
    total = streamed.input_tokens + streamed.cache_read_input_tokens
    assert total == usage.input_tokens + usage.cache_read_input_tokens > prompt_tokens
    # count_tokens counts what the model reads.
    counted = client.messages.count_tokens(
        model=NAME, messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == prompt_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(served: Served) -> None:
    client = _claude(served.root)
    asked = {"model": NAME, "max_tokens": 40, "extra_body": {"temperature": 0},
             "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    whole = client.messages.create(**asked).content[0].text  # type: ignore[arg-type, union-attr]
    stop = whole.split()[len(whole.split()) // 2]
    cut = client.messages.create(**asked, stop_sequences=[stop, "never-written"])  # type: ignore[arg-type]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[: whole.index(stop)]  # type: ignore[union-attr]


def test_a_tool_call_and_its_result_go_round_from_the_cache(served: Served) -> None:
    client = _claude(served.root)
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    first = client.messages.create(
        model=NAME, max_tokens=60, **GREEDY, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"}, messages=[question],  # type: ignore[list-item]
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input["city"] in CITY["enum"]  # type: ignore[index]
    # Streamed: the call's input comes as input_json_delta, put together by the client.
    with client.messages.stream(
        model=NAME, max_tokens=60, **GREEDY, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"}, messages=[question],  # type: ignore[list-item]
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (call.name, call.input)
    ]
    second = client.messages.create(
        model=NAME, max_tokens=30, **GREEDY, tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            question,
            {"role": "assistant", "content": [call.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "Clear, 21 C."}]}]},
        ],  # type: ignore[list-item]
    )  # fmt: skip
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content and second.content[0].type == "text"
    assert second.usage.cache_read_input_tokens is not None
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.cache_read_input_tokens >= first_prompt  # only the result was read


def test_bad_requests_get_anthropics_error_shape(served: Served) -> None:
    client = _claude(served.root)
    hello = [{"role": "user", "content": "hi"}]

    def refused(status: int, **body: object) -> str:
        response = httpx.post(f"{served.root}/v1/messages", json=body, timeout=60,
                              headers={"x-api-key": "s3cret"})  # fmt: skip
        assert response.status_code == status, response.text
        error = response.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        return str(error["error"]["type"]) + ": " + str(error["error"]["message"])

    assert "max_tokens is required" in refused(400, messages=hello)
    assert "invalid_request_error" in refused(400, messages=hello)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    assert "source.data must be an image's bytes in base64" in refused(
        400, max_tokens=5, messages=[{"role": "user", "content": [image]}]
    )
    assert "block type 'audio'" in refused(
        400, max_tokens=5, messages=[{"role": "user", "content": [{"type": "audio"}]}]
    )
    assert "logit_bias: not a field" in refused(400, max_tokens=5, messages=hello, logit_bias={})
    assert "temperature must be between 0 and 1" in refused(
        400, max_tokens=5, messages=hello, temperature=1.5
    )
    assert "web_search" in refused(
        400, max_tokens=5, messages=hello, tools=[{"type": "web_search_20250305", "name": "w"}]
    )
    assert "not among the tools" in refused(
        400,
        max_tokens=5,
        messages=hello,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "x"},
    )
    too_long = refused(400, max_tokens=5, messages=[{"role": "user", "content": "word " * 3000}])
    assert "prompt is too long" in too_long
    response = httpx.post(f"{served.root}/v1/messages", content=b"{not json",
                          headers={"x-api-key": "s3cret", "content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400 and response.json()["type"] == "error"
    big = httpx.post(f"{served.root}/v1/messages", content=b"x" * (MAX_BODY_BYTES + 1),
                     headers={"x-api-key": "s3cret"})  # fmt: skip
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    # The key: Anthropic's header or a bearer token; a wrong one is Anthropic's 401.
    with pytest.raises(anthropic.AuthenticationError):
        _claude(served.root, "wrong").messages.create(model=NAME, max_tokens=2, messages=hello)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=NAME, max_tokens=2, messages=[])
    assert "messages must be a non-empty list" in str(raised.value)
    bearer = httpx.post(f"{served.root}/v1/messages", timeout=60,
                        headers={"authorization": "Bearer s3cret", "anthropic-version": "2023-06-01"},
                        json={"model": NAME, "max_tokens": 2, "messages": hello})  # fmt: skip
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    assert served.runner.counters.queued == 0 and served.runner.counters.running == 0


def test_a_reasoning_models_thinking_comes_as_thinking_blocks(tiny_model: Path) -> None:
    # DeepSeek-R1's real template opens <think> in the prompt; a random model never closes
    # it, so all it writes is thinking.
    template = str(TEMPLATES / "deepseek-r1-distill-qwen.jinja")
    engine = Engine(tiny_model, LoadOptions(n_ctx=512, n_threads=2, template=template))
    runner = ModelRunner(engine, StateStore(Path(tempfile.mkdtemp())), "tiny")
    server = BackgroundServer(Router.of_one(runner))
    try:
        client = anthropic.Anthropic(base_url=server.root, api_key="none", max_retries=0)
        asked = {"model": "tiny", "max_tokens": 12, "extra_body": {"temperature": 0},
                 "messages": [{"role": "user", "content": "Why?"}]}  # fmt: skip
        whole = client.messages.create(**asked)  # type: ignore[arg-type]
        with client.messages.stream(**asked) as stream:  # type: ignore[arg-type]
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
    finally:
        server.close()
        runner.close()
        engine.close()
    assert [block.type for block in whole.content] == ["thinking"]
    assert whole.content[0].thinking  # type: ignore[union-attr]
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert "thinking" in kinds and "signature" in kinds  # thinking_delta, then its signature


def test_the_billing_stamp_of_an_agent_does_not_break_the_cache(served: Served) -> None:
    client = _claude(served.root)

    def ask(stamp: str) -> anthropic.types.Message:
        system = f"x-anthropic-billing-header: cc_version=2.1; cch={stamp};You help with code."
        return client.messages.create(
            model=NAME, max_tokens=3, **GREEDY, system=system,
            messages=[{"role": "user", "content": json.dumps({"task": "sort a list"})}],
        )  # fmt: skip

    ask("a5145")
    again = ask("0b7e2")  # a new stamp: the same prompt, read from the cache
    assert again.usage.cache_read_input_tokens is not None
    assert again.usage.input_tokens <= 1 and again.usage.cache_read_input_tokens > 20
