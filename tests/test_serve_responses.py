"""OpenAI's Responses API on ``localchat serve``, through the official ``openai`` client
against a real uvicorn server on SmolLM2: the same greedy reply as chat completions, a
conversation continued by ``previous_response_id`` alone whose prompt comes from the
cache, the event stream, function calls and their outputs, kept responses read and
deleted, and bad requests refused with OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_serve import NAME, QUESTION, Served, _client

CITY = {"type": "string", "enum": ["Oslo", "Rome", "Paris"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
}


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states")
    yield server
    server.close()


def test_a_response_is_the_chat_reply_and_previous_response_id_continues_from_the_cache(
    served: Served,
) -> None:
    client = _client(served.root)
    first = client.responses.create(
        model="gpt-5-codex", input=QUESTION, max_output_tokens=40, temperature=0
    )
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40
    )
    text = chat.choices[0].message.content
    assert first.output_text == text and first.model == NAME
    assert first.status == "incomplete" and first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.usage is not None and first.usage.output_tokens == 40
    # Only the new input, with the id: the conversation goes on, its prompt from the cache.
    second = client.responses.create(
        model=NAME, previous_response_id=first.id, input="Thanks.", max_output_tokens=20,
        temperature=0,
    )  # fmt: skip
    assert second.usage is not None and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + 30
    resent = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=20,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text},
                  {"role": "user", "content": "Thanks."}],  # type: ignore[list-item]
    )  # fmt: skip
    assert second.output_text == resent.choices[0].message.content
    # Streamed: the Responses events, and the same text.
    kinds = []
    with client.responses.stream(
        model=NAME, input=QUESTION, max_output_tokens=40, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        streamed = stream.get_final_response()
    assert streamed.output_text == text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.delta" in kinds
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert streamed.status == "incomplete"
    # Kept: read back, counted, deleted.
    assert client.responses.retrieve(second.id).output_text == second.output_text
    counted = client.responses.input_tokens.count(model=NAME, input=QUESTION)
    assert counted.input_tokens == first.usage.input_tokens
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, previous_response_id=second.id, input="And?")
    unkept = client.responses.create(model=NAME, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_function_call_and_its_output_go_round(served: Served) -> None:
    client = _client(served.root)
    first = client.responses.create(
        model=NAME, input="What is the weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=60,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in CITY["enum"]
    with client.responses.stream(
        model=NAME, input="What is the weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", temperature=0, max_output_tokens=60,
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert [i.arguments for i in streamed.output if i.type == "function_call"] == [
        calls[0].arguments
    ]
    second = client.responses.create(
        model=NAME, previous_response_id=first.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"sky": "clear"}'}],
        temperature=0, max_output_tokens=20,
    )  # fmt: skip
    assert second.output_text and second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # The same turn sent whole, as items, without the id: the same reply.
    whole = client.responses.create(
        model=NAME, tools=[WEATHER], temperature=0, max_output_tokens=20,  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": '{"sky": "clear"}'},
        ],
    )  # fmt: skip
    assert whole.output_text == second.output_text


def test_text_format_holds_the_reply_to_a_schema(served: Served) -> None:
    schema = {"type": "object", "properties": {"city": CITY}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    reply = _client(served.root).responses.create(
        model=NAME, input="Name a city.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    assert reply.status == "completed"
    assert json.loads(reply.output_text)["city"] in CITY["enum"]


def test_bad_requests_get_openais_error_shape(served: Served) -> None:
    def refused(status: int, **body: object) -> str:
        response = httpx.post(f"{served.root}/v1/responses", json=body, timeout=60)
        assert response.status_code == status, response.text
        assert set(response.json()) == {"error"}
        return str(response.json()["error"]["message"])

    assert "input is required" in refused(400, model=NAME)
    assert "item type 'computer_call'" in refused(400, input=[{"type": "computer_call"}])
    assert "image_url must be a data URI" in refused(400, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])  # fmt: skip
    assert "'web_search'" in refused(400, input="hi", tools=[{"type": "web_search"}])
    assert "background" in refused(400, input="hi", background=True)
    assert "top_logprobs: not a field" in refused(400, input="hi", top_logprobs=2)
    assert "no response kept" in refused(404, input="hi", previous_response_id="resp_nope")
    assert "context_length_exceeded" not in refused(400, input="word " * 3000)
    too_long = httpx.post(f"{served.root}/v1/responses", json={"input": "word " * 3000})
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    missing = httpx.get(f"{served.root}/v1/responses/resp_nope")
    assert missing.status_code == 404 and "error" in missing.json()
