"""Nothing a client sends is silently ignored: ``logprobs``, ``logit_bias``, llama-server's
``grammar``, ``n`` replies that share the prompt's evaluation, prompts as token ids, more
than four stop strings, ``null`` meaning the default, ``timings`` with the usage chunk,
``/tokenize`` pieces that are not whole UTF-8, CORS only where asked for, and any other
field refused by name — through the official ``openai`` client on SmolLM2."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_serve import NAME, QUESTION, Served, _client

ASK = [{"role": "user", "content": QUESTION}]


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states", parallel=3, aliases=("gpt-4o-mini",),
                    cors_origins=("http://localhost:3000",))  # fmt: skip
    yield server
    server.close()


def test_logprobs_on_chat_and_completions_streamed_and_not(served: Served) -> None:
    client = _client(served.root)
    whole = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 12
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []).decode() == entry.token
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1.0001
    chunks = list(client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,  # type: ignore[arg-type]
        stream=True))  # fmt: skip
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    text = client.completions.create(
        model=NAME, prompt="def add(a, b):", max_tokens=8, temperature=0, logprobs=2
    )
    found = text.choices[0].logprobs
    assert found is not None and found.tokens and "".join(found.tokens) == text.choices[0].text
    assert found.top_logprobs is not None and all(len(t) == 2 for t in found.top_logprobs)
    assert found.text_offset is not None and found.text_offset[0] == 0


def test_logit_bias_bans_and_forces_tokens(served: Served) -> None:
    client = _client(served.root)
    plain = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        max_tokens=5,
        temperature=0,
        logprobs=True,  # type: ignore[arg-type]
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    first = plain.choices[0].logprobs.content[0].token
    first_id = httpx.post(f"{served.root}/tokenize", json={"content": first}).json()["tokens"]
    banned = client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=5, temperature=0,  # type: ignore[arg-type]
        logit_bias={str(first_id[0]): -100},
    )  # fmt: skip
    assert not (banned.choices[0].message.content or "").startswith(first)
    forced_id = httpx.post(f"{served.root}/tokenize", json={"content": " banana"}).json()
    forced = client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=3, temperature=0,  # type: ignore[arg-type]
        logit_bias={str(forced_id["tokens"][0]): 100},
    )  # fmt: skip
    piece = httpx.post(f"{served.root}/detokenize", json={"tokens": forced_id["tokens"][:1]})
    assert (forced.choices[0].message.content or "").startswith(piece.json()["content"] * 3)


def test_n_replies_share_the_prompts_evaluation(served: Served) -> None:
    client = _client(served.root)
    counters = served.runner.counters
    before = counters.evaluated_tokens
    three = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=ASK,
        max_tokens=16,
        n=3,
        temperature=1.0,
        seed=7,  # type: ignore[arg-type]
    )
    assert three.model == "gpt-4o-mini"  # an alias is answered under its own name
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1  # each its own seed
    assert three.usage is not None and three.usage.completion_tokens == 48
    prompt = three.usage.prompt_tokens
    # The prompt was read once; the other two copied its cells (a token each to start).
    assert counters.evaluated_tokens - before <= prompt + 2
    chunks = list(client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=8, n=2, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))  # fmt: skip
    by_index = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index[0] == by_index[1] and by_index[0]  # greedy: the same reply twice
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].model_extra and "timings" in chunks[-1].model_extra  # with the usage


def test_llama_server_fields_token_prompts_stops_and_nulls(served: Served) -> None:
    url = f"{served.root}/v1/chat/completions"
    grammar = 'root ::= "yes" | "no"'
    said = httpx.post(url, timeout=60, json={"messages": ASK, "grammar": grammar,
                                              "temperature": 0}).json()  # fmt: skip
    assert said["choices"][0]["message"]["content"] in ("yes", "no")
    bad = httpx.post(url, json={"messages": ASK, "grammar": "root ::= ("})
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"]
    client = _client(served.root)
    ids = httpx.post(f"{served.root}/tokenize", json={"content": "def add(a, b):"}).json()
    by_text = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=8,
                                        temperature=0)  # fmt: skip
    by_ids = client.completions.create(model=NAME, prompt=ids["tokens"], max_tokens=8,
                                       temperature=0)  # fmt: skip
    assert by_ids.choices[0].text == by_text.choices[0].text
    stops = ["zz1", "zz2", "zz3", "zz4", "zz5", "\n"]
    stopped = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=40,
                                        temperature=0, stop=stops)  # fmt: skip
    assert "\n" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    nulls = {"model": None, "stream": None, "max_tokens": None, "temperature": None, "seed": None,
             "stop": None, "tools": None, "tool_choice": None, "n": None, "logprobs": None,
             "response_format": None, "stream_options": None, "top_p": None, "user": None}  # fmt: skip
    answered = httpx.post(url, timeout=60, json={**nulls, "messages": ASK, "max_tokens": 2})
    assert answered.status_code == 200, answered.text


def test_tokenize_pieces_cors_and_fields_refused_by_name(served: Served) -> None:
    text = "llama 🦙"
    pieces = httpx.post(f"{served.root}/tokenize",
                        json={"content": text, "with_pieces": True}).json()["tokens"]  # fmt: skip
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes, split
    joined = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    )
    assert joined == text.encode()
    url = f"{served.root}/v1/chat/completions"
    allowed = httpx.options(url, headers={
        "origin": "http://localhost:3000", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})  # fmt: skip
    assert allowed.headers.get("access-control-allow-origin") == "http://localhost:3000"
    other = httpx.options(url, headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})  # fmt: skip
    assert "access-control-allow-origin" not in other.headers
    # A page's simple form post is still refused (no key: the browser guard).
    form = httpx.post(url, content=b"{}", headers={"origin": "http://localhost:3000",
                                                   "content-type": "text/plain"})  # fmt: skip
    assert form.status_code == 415

    def refused(path: str, **body: object) -> str:
        response = httpx.post(f"{served.root}{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        return str(response.json()["error"]["message"])

    assert "prediction: not a field" in refused("/v1/chat/completions", messages=ASK,
                                                prediction={"type": "content"})  # fmt: skip
    assert "echo" in refused("/v1/completions", prompt="hi", echo=True)
    assert "best_of" in refused("/v1/completions", prompt="hi", best_of=3)
    assert "top_logprobs needs logprobs" in refused("/v1/chat/completions", messages=ASK,
                                                    top_logprobs=2)  # fmt: skip
    assert "token ids run from 0" in refused("/v1/completions", prompt=[10**9])
    assert "logit_bias" in refused("/v1/chat/completions", messages=ASK, logit_bias={"x": 1})
    models = httpx.get(f"{served.root}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [NAME, "gpt-4o-mini"]
    assert json.loads(httpx.get(f"{served.root}/api/tags").text)["models"][1]["name"] == (
        "gpt-4o-mini:latest"
    )
