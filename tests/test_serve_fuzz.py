"""Every endpoint of ``localchat serve`` under bad input: malformed bodies, and valid JSON
with random fields and values (hypothesis), thrown at each API's routes. The only answer
allowed is a 2xx or a 4xx in that API's error shape — never a 5xx, never a traceback — and
the server answers a plain request afterwards with nothing left queued. Clients that leave
mid-stream, on every API, stop their reply and keep what was generated in the cache."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.server.app import BackgroundServer
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.state.kvstate import StateStore
from tests.test_serve import NAME, Served

HELLO = [{"role": "user", "content": "hi"}]
# A valid body per route: the fuzz replaces, adds and drops fields of these.
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HELLO, "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"messages": HELLO, "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": HELLO},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/responses/input_tokens": {"input": "hi"},
    "/api/chat": {"messages": HELLO, "options": {"num_predict": 4}},
    "/api/generate": {"prompt": "hi", "options": {"num_predict": 4}},
    "/api/show": {"model": "x"},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
FIELDS = sorted({
    "model", "messages", "prompt", "input", "max_tokens", "max_output_tokens", "stream",
    "temperature", "top_p", "top_k", "stop", "stop_sequences", "tools", "tool_choice", "n",
    "logprobs", "top_logprobs", "logit_bias", "response_format", "json_schema", "grammar",
    "system", "instructions", "options", "format", "think", "raw", "content", "tokens",
    "previous_response_id", "text", "stream_options", "seed", "with_pieces", "metadata",
    "output_config", "keep_alive", "images", "suffix", "role", "type", "name",
})  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip
# Values shaped like what the fields hold, so the fuzz reaches past the first type check.
SHAPED = JSON | st.sampled_from([
    HELLO, [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
    [{"type": "tool_result"}], [{"type": "function_call_output"}], [{"role": "tool"}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
    {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}, "required",
    {"type": "tool", "name": "f"}, {"num_ctx": 1}, {"num_predict": -1}, "json", -1, 0, 10**9,
    [-5], [[1, 2]], {"format": {"type": "json_schema"}}, "root ::= (", ["\n"] * 9,
])  # fmt: skip


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[str]:
    from localchat.models.demo import make_demo_model

    model = make_demo_model(models_dir / "fuzz-tiny.gguf", "tiny", "Q4_K_M", seed=3)
    engine = Engine(model, LoadOptions(n_ctx=256, n_threads=2))
    runner = ModelRunner(engine, StateStore(Path(tempfile.mkdtemp())), "tiny", parallel=2)
    server = BackgroundServer(Router.of_one(runner))
    yield server.root
    assert runner.counters.queued == 0 and runner.counters.running == 0
    server.close()
    runner.close()
    engine.close()


def _sent(root: str, path: str, body: bytes) -> httpx.Response:
    response = httpx.post(f"{root}{path}", content=body, timeout=120,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code < 500, (path, body[:300], response.text[:300])
    if response.status_code >= 400:
        error = response.json()
        assert "error" in error, error  # each API's shape has one
        assert "Traceback" not in response.text
    return response


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(sorted(VALID)),
    changes=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), SHAPED, max_size=3),
    dropped=st.lists(st.sampled_from(FIELDS), max_size=2),
)
def test_random_fields_and_values_never_fail_the_server(
    fuzzed: str, path: str, changes: dict[str, Any], dropped: list[str]
) -> None:
    body = {k: v for k, v in {**VALID[path], **changes}.items() if k not in dropped}
    _sent(fuzzed, path, json.dumps(body).encode())


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(VALID)), raw=st.binary(max_size=64) | JSON.map(
    lambda v: json.dumps(v).encode()))  # fmt: skip
def test_malformed_bodies_never_fail_the_server(fuzzed: str, path: str, raw: bytes) -> None:
    _sent(fuzzed, path, raw)


def test_after_the_fuzz_the_server_still_answers(fuzzed: str) -> None:
    for path in ("/v1/responses/resp_nothing", "/api/tags", "/api/ps", "/props", "/v1/models"):
        assert httpx.get(f"{fuzzed}{path}").status_code in (200, 404)
    reply = httpx.post(f"{fuzzed}/v1/chat/completions", timeout=60,
                       json={"messages": HELLO, "max_tokens": 3})  # fmt: skip
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


STREAMS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a long story."}],
                                      "max_tokens": 1000, "stream": True}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Tell a long story."}],
                                  "max_tokens": 1000, "stream": True}),
    "responses": ("/v1/responses", {"input": "Tell a long story.", "max_output_tokens": 1000,
                                    "stream": True}),
    "ollama": ("/api/chat", {"messages": [{"role": "user", "content": "Tell a long story."}],
                             "options": {"num_predict": 1000, "temperature": 0}}),
}  # fmt: skip


@pytest.fixture
def served(smollm2: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(smollm2, tmp_path / "states")
    yield server
    server.close()


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_client_that_leaves_mid_stream_stops_its_reply_on_every_api(
    served: Served, api: str
) -> None:
    path, body = STREAMS[api]
    greedy = {} if api == "ollama" else {"temperature": 0}
    with httpx.stream("POST", f"{served.root}{path}",
                      json={**body, **greedy, "model": NAME}) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(8):
            next(lines)
    deadline = time.monotonic() + 30
    while served.runner.counters.running and time.monotonic() < deadline:
        time.sleep(0.05)
    counters = served.runner.counters
    assert counters.running == 0 and counters.queued == 0
    assert 0 < counters.generated_tokens < 200  # stopped at once, not at 1000
    assert len(served.runner.batch.tokens[0]) > 20  # what was generated stays in the cache
    again = httpx.post(f"{served.root}/v1/chat/completions", timeout=60,
                       json={"messages": HELLO, "max_tokens": 2})  # fmt: skip
    assert again.status_code == 200


FAILED_SHAPES = {  # what a failure inside the model's step reads as, not streamed, per API
    "chat": lambda body: body["error"]["type"] == "server_error",
    "messages": lambda body: body["type"] == "error" and body["error"]["type"] == "api_error",
    "responses": lambda body: body["error"]["type"] == "server_error",
    "ollama": lambda body: isinstance(body["error"], str),
}


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_failure_inside_a_step_is_that_apis_500_and_the_server_goes_on(
    served: Served, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from localchat.backends.llama import sampler

    def broken(*_args: object) -> int:
        raise TypeError("a sampler that fails")

    monkeypatch.setattr(sampler.SequenceSampler, "sample", broken)
    path, body = STREAMS[api]
    answer = httpx.post(f"{served.root}{path}", timeout=60,
                        json={**body, "stream": False, "model": NAME})  # fmt: skip
    assert answer.status_code == 500 and FAILED_SHAPES[api](answer.json())
    assert "see its terminal" in answer.text and "Traceback" not in answer.text
    with httpx.stream("POST", f"{served.root}{path}",
                      json={**body, "model": NAME}) as streamed:  # fmt: skip
        text = "".join(streamed.iter_text())
    assert "the server failed" in text and "Traceback" not in text  # the stream's last event
    monkeypatch.undo()
    again = httpx.post(f"{served.root}/v1/chat/completions", timeout=60,
                       json={"messages": HELLO, "max_tokens": 2})  # fmt: skip
    assert again.status_code == 200
