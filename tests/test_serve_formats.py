"""Structured output through ``localchat serve``: OpenAI's ``response_format`` (and
llama-server's ``json_schema``) and Anthropic's ``output_config.format`` hold SmolLM2-135M
to JSON that follows the schema, streamed or not, by a llama.cpp grammar built from it; a
schema the grammar cannot express is a 400 that names the part."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.test_serve import NAME, Served, _client

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]},
                 "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}  # fmt: skip
ASK = [{"role": "user", "content": "Describe a person called Ada as JSON."}]


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states")
    yield server
    server.close()


def _is_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "pets"}, person
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool)
    assert set(person["pets"]) <= {"cat", "dog"} and len(person["pets"]) <= 3


def test_openai_response_format_holds_the_reply_to_the_schema(served: Served) -> None:
    client = _client(served.root)
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}}  # fmt: skip
    whole = client.chat.completions.create(
        model=NAME, messages=ASK, response_format=form, max_tokens=120, temperature=0,  # type: ignore[arg-type]
    )  # fmt: skip
    assert whole.choices[0].finish_reason == "stop"  # the grammar ends it, not the limit
    _is_person(whole.choices[0].message.content or "")
    chunks = client.chat.completions.create(
        model=NAME, messages=ASK, response_format=form, max_tokens=120, temperature=0,  # type: ignore[arg-type]
        stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    # Sampled at a high temperature, still the schema's shape.
    for seed in range(3):
        hot = client.chat.completions.create(
            model=NAME, messages=ASK, response_format=form, max_tokens=120, temperature=1.5,  # type: ignore[arg-type]
            seed=seed,
        )  # fmt: skip
        _is_person(hot.choices[0].message.content or "")
    anything = client.chat.completions.create(
        model=NAME, messages=ASK, response_format={"type": "json_object"}, max_tokens=60,
        temperature=0,
    )  # fmt: skip
    if anything.choices[0].finish_reason == "stop":  # cut by the limit it is no whole object
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    # llama-server's own field.
    raw = httpx.post(f"{served.root}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "json_schema": PERSON, "max_tokens": 120, "temperature": 0}).json()  # fmt: skip
    assert raw["choices"][0]["message"]["content"] == whole.choices[0].message.content


def test_anthropic_output_config_format_holds_the_reply_to_the_schema(served: Served) -> None:
    client = anthropic.Anthropic(base_url=served.root, api_key="none", max_retries=0)
    message = client.messages.create(
        model=NAME, max_tokens=120, messages=ASK,  # type: ignore[arg-type]
        output_config={"format": {"type": "json_schema", "schema": PERSON}, "effort": "low"},
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert message.stop_reason == "end_turn"
    _is_person(message.content[0].text)  # type: ignore[union-attr]


def test_a_schema_without_a_grammar_is_a_400_that_names_the_part(served: Served) -> None:
    def refused(path: str, **body: object) -> str:
        response = httpx.post(f"{served.root}{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        return str(response.json()["error"]["message"])

    odd = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    message = refused("/v1/chat/completions", messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "odd", "schema": odd}})  # fmt: skip
    assert "cannot be turned into a grammar" in message and "'not'" in message
    message = refused("/v1/messages", messages=ASK, max_tokens=5,
                      output_config={"format": {"type": "json_schema", "schema": odd}})  # fmt: skip
    assert "cannot be turned into a grammar" in message
    assert "response_format.type must be" in refused(
        "/v1/chat/completions", messages=ASK, response_format={"type": "yaml"}
    )
    assert "output_config.format must be" in refused(
        "/v1/messages", messages=ASK, max_tokens=5, output_config={"format": {"type": "xml"}}
    )
    assert served.runner.counters.queued == 0 and served.runner.scheduler.preparing == 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_grammar_judging_the_best_candidates_picks_what_the_whole_vocabulary_would(
    served: Served, monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """A grammar judges the best logits first (llama.cpp's over 49k tokens costs more than
    SmolLM2's step); the reply must be the one the grammar over every token gives."""
    from localchat.backends.llama import sampler

    judged: list[int] = []
    real_apply = sampler._apply

    def counting(chain: object, candidates: object) -> int:
        judged.append(len(candidates))  # type: ignore[arg-type]
        return real_apply(chain, candidates)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "_apply", counting)
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": ASK, "max_tokens": 80, "temperature": temperature, "seed": 7,
            "response_format": form}  # fmt: skip

    def reply() -> str:
        answer = httpx.post(f"{served.root}/v1/chat/completions", json=body, timeout=300)
        return str(answer.json()["choices"][0]["message"]["content"])

    quick = reply()
    # The short way was taken: a few best tokens judged, not one alone or all 49k.
    assert any(1 < count <= 2 * max(sampler.CANDIDATES) for count in judged)
    monkeypatch.setattr(sampler, "CANDIDATES", ())
    assert reply() == quick
    _is_person(quick)
