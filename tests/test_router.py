"""Many models behind one server (``server/router.py``), through the official openai and
ollama clients: every model listed with its status, loaded on demand (once for requests
side by side), the least recently used idle one unloaded to make room with its states saved
so a returning conversation restores them, keep_alive, the load and unload endpoints, a 503
with Retry-After where no room can be made, and a model that fails to load failing alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from localchat.errors import ModelLoadError
from localchat.models.launch import LaunchOptions
from localchat.paths import app_paths
from localchat.server.app import BackgroundServer
from localchat.server.model_source import LibrarySource
from localchat.server.router import Router, ServedEntry
from localchat.server.runner import ModelRunner
from localchat.state.kvstate import StateStore

LAUNCH = LaunchOptions(n_ctx=1024, n_threads=2, kv_type="q8_0")

LOAD_S = 120.0  # a request that loads a model waits for it


class CountingSource(LibrarySource):
    """The server's own source, counting its loads."""

    def __init__(self, states: Path) -> None:
        super().__init__(app_paths(), LAUNCH, StateStore(states), parallel=1)
        self.loads: list[str] = []
        self.router: Router | None = None
        self.loaded_at_load: list[int] = []  # models in memory as each load began
        self.gate = threading.Event()  # a load waits for it (set: no wait)
        self.gate.set()
        self.refuse: set[str] = set()  # models whose load fails as llama.cpp's would

    def load(self, entry: ServedEntry) -> ModelRunner:
        self.loads.append(entry.name)
        if self.router is not None:
            self.loaded_at_load.append(len(self.router.loaded()))
        assert self.gate.wait(60)
        if entry.name in self.refuse:
            raise ModelLoadError(f"{entry.path}: llama.cpp could not load the model")
        return super().load(entry)


@dataclass
class Routed:
    router: Router
    source: CountingSource
    server: BackgroundServer

    @property
    def root(self) -> str:
        return self.server.root

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.root}/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        self.server.close()
        self.router.close()


def _routed(
    entries: list[ServedEntry], states: Path, max_models: int | None = None, **kw: object
) -> Routed:
    source = CountingSource(states)
    router = Router(entries, source, max_models=max_models, **kw)  # type: ignore[arg-type]
    source.router = router
    return Routed(router, source, BackgroundServer(router))


@pytest.fixture
def two(smollm2: Path, tiny_model: Path, tmp_path: Path) -> Iterator[Routed]:
    """SmolLM2 and a generated model, room for one at a time."""
    entries = [ServedEntry("smol", smollm2, ("smol-alias",)), ServedEntry("tiny", tiny_model)]
    routed = _routed(entries, tmp_path / "states", max_models=1)
    yield routed
    routed.close()


def _ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].message.content or "", usage.prompt_tokens, cached


def test_every_model_is_listed_with_its_status_and_loaded_when_asked_for(two: Routed) -> None:
    listed = {m.id: m for m in two.openai().models.list()}
    assert {"smol", "smol-alias", "tiny"} <= set(listed)
    states = httpx.get(f"{two.root}/models").json()["data"]
    assert {e["id"]: e["status"]["value"] for e in states}["tiny"] == "unloaded"
    assert ollama.Client(host=two.root).ps().models == []
    tags = {m.model for m in ollama.Client(host=two.root).list().models}
    assert {"smol:latest", "tiny:latest"} <= tags
    _ask(two.openai(), "tiny", [{"role": "user", "content": "hello"}])
    loaded = ollama.Client(host=two.root).ps().models
    assert [m.model for m in loaded] == ["tiny:latest"]
    entry = two.router.entry_of("tiny")
    assert (loaded[0].size or 0) > entry.path.stat().st_size  # weights and the KV cache
    states = httpx.get(f"{two.root}/models").json()["data"]
    assert {e["id"]: e["status"]["value"] for e in states}["tiny"] == "loaded"
    assert two.source.loads == ["tiny"]


def test_an_unknown_model_is_a_404_naming_the_models(two: Routed) -> None:
    with pytest.raises(openai.NotFoundError, match=r"'nope' is not served here.*smol, tiny"):
        _ask(two.openai(), "nope", [{"role": "user", "content": "hi"}])
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=two.root).chat(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 404


def test_conversations_on_two_models_with_room_for_one_restore_from_disk(two: Routed) -> None:
    """Alternating two conversations over two models that cannot both be loaded: each
    returning conversation restores its states (saved when its model was unloaded) and
    evaluates only its new message."""
    client = two.openai()
    talks = {
        m: [{"role": "system", "content": f"You answer about {m}. " * 40}] for m in ("smol", "tiny")
    }
    for round_ in range(3):
        for model in ("smol", "tiny"):
            talk = talks[model]
            talk.append({"role": "user", "content": f"question {round_}?"})
            text, prompt, cached = _ask(client, model, talk)
            talk.append({"role": "assistant", "content": text})
            if round_ > 0:  # back after the other model took its memory
                assert cached >= 0.9 * prompt, (model, round_, prompt, cached)
                assert prompt - cached <= 24  # the new message and the template around it
    assert two.source.loads == ["smol", "tiny"] * 3  # one loaded at a time, each time


def _waiting_for(routed: Routed, name: str, count: int) -> None:
    """Until ``count`` requests wait for ``name``'s load (the gate holds it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = next(s for s in routed.router.statuses() if s.entry.name == name)
        if status.waiters >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never waited for {name}")


def _asking(routed: Routed, models: tuple[str, ...]) -> tuple[list[threading.Thread], list[str]]:
    results: list[str] = []

    def ask(model: str) -> None:
        results.append(_ask(routed.openai(), model, [{"role": "user", "content": "hi"}])[0])

    threads = [threading.Thread(target=ask, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    return threads, results


def test_requests_for_two_models_at_once_never_hold_more_than_allowed(two: Routed) -> None:
    two.source.gate.clear()
    threads, results = _asking(two, ("smol", "smol"))
    _waiting_for(two, "smol", 2)  # smol's load began
    more, more_results = _asking(two, ("tiny",))  # no room while smol's load is under way
    two.source.gate.set()
    for thread in threads + more:
        thread.join(timeout=120)
    assert len(results + more_results) == 3
    assert set(two.source.loads) == {"smol", "tiny"}
    assert two.source.loaded_at_load == [0] * len(two.source.loads)  # room for one: one


def test_two_requests_for_an_unloaded_model_load_it_once(two: Routed) -> None:
    two.source.gate.clear()
    threads, results = _asking(two, ("smol", "smol"))
    _waiting_for(two, "smol", 2)  # both wait for the one load
    two.source.gate.set()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 2
    assert two.source.loads == ["smol"]


def test_keep_alive_zero_unloads_after_the_reply_and_the_endpoints_load_and_unload(
    two: Routed,
) -> None:
    client = ollama.Client(host=two.root)
    loading = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}],
                          keep_alive=0, options={"num_predict": 4})  # fmt: skip
    two.router.reap_now()
    assert client.ps().models == []
    # A load waits for the model (seconds on a loaded machine): not httpx's 5 s default.
    loaded = httpx.post(f"{two.root}/models/load", json={"model": "smol"}, timeout=LOAD_S)
    assert loaded.json()["success"]
    assert [m.model for m in client.ps().models] == ["smol:latest"]
    answer = httpx.post(f"{two.root}/models/unload", json={"model": "smol"}, timeout=LOAD_S).json()
    assert answer == {"success": True, "unloaded": True}
    assert client.ps().models == []
    # Ollama's own way: an empty prompt loads, and with keep_alive 0 unloads.
    assert client.generate(model="tiny", prompt="").done_reason == "load"
    assert [m.model for m in client.ps().models] == ["tiny:latest"]
    assert client.generate(model="tiny", prompt="", keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    warm = client.chat(model="smol", messages=[{"role": "user", "content": "hi"}],
                       options={"num_predict": 2})  # fmt: skip
    again = client.chat(model="smol", messages=[{"role": "user", "content": "hi"}],
                        options={"num_predict": 2})  # fmt: skip
    assert (loading.load_duration or 0) > (again.load_duration or 0)  # waited for tiny's load
    assert (warm.load_duration or 0) > (again.load_duration or 0)  # and smol's


def test_a_busy_model_is_never_unloaded_a_request_waits_then_gets_a_503(
    smollm2: Path, tiny_model: Path, tmp_path: Path
) -> None:
    entries = [ServedEntry("smol", smollm2), ServedEntry("tiny", tiny_model)]
    routed = _routed(entries, tmp_path / "states", max_models=1, wait_s=1.0)
    try:
        body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 900, "stream": True, "logit_bias": {"0": -100, "2": -100}}  # fmt: skip
        with httpx.stream("POST", f"{routed.root}/v1/chat/completions", json=body,
                          timeout=120) as streaming:  # fmt: skip
            lines = streaming.iter_lines()
            while '"content"' not in next(lines):
                pass
            other = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            refused = httpx.post(f"{routed.root}/v1/chat/completions", json=other, timeout=60)
            assert refused.status_code == 503
            assert refused.headers["Retry-After"]
            assert "tiny cannot be loaded now" in refused.json()["error"]["message"]
        assert routed.source.loads == ["smol"]
    finally:
        routed.close()


def test_a_model_that_fails_to_load_is_that_requests_error_alone(
    tiny_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    entries = [ServedEntry("tiny", tiny_model), ServedEntry("broken", broken)]
    routed = _routed(entries, tmp_path / "states")
    try:
        client = routed.openai()
        with pytest.raises(openai.APIStatusError) as caught:
            _ask(client, "broken", [{"role": "user", "content": "hi"}])
        message = caught.value.response.json()["error"]["message"]
        assert str(broken) in message and "\n" not in message
        routed.source.refuse.add("tiny")  # a file that reads, that llama.cpp refuses
        with pytest.raises(openai.InternalServerError, match="could not load the model"):
            _ask(client, "tiny", [{"role": "user", "content": "hi"}])
        routed.source.refuse.clear()  # nothing is left stuck: it loads when it can
        assert _ask(client, "tiny", [{"role": "user", "content": "hi"}])[1] > 0
    finally:
        routed.close()


def test_names_aliases_and_the_default(two: Routed) -> None:
    assert two.router.loaded() == []
    assert two.router.entry_of(None).name == "smol"  # the first, while none is loaded
    assert two.router.entry_of("smol-alias:latest").name == "smol"
    _ask(two.openai(), "tiny", [{"role": "user", "content": "hi"}])
    assert two.router.entry_of("").name == "tiny"  # the model used last


def test_the_library_is_served_under_the_names_users_know(
    smollm2: Path, tiny_model: Path, tmp_path: Path
) -> None:
    from localchat.models.demo_bert import make_embedding_model
    from localchat.models.hardware import detect_hardware
    from localchat.models.library import Library
    from localchat.server.model_source import library_entries

    library = Library(app_paths(), detect_hardware())
    library.add_local(smollm2)
    library.add_local(tiny_model)
    library.add_local(make_embedding_model(tmp_path / "minilm.gguf", "bert-minilm"))
    chat, embedding = library_entries(Library(app_paths(), detect_hardware()))
    assert [e.name for e in chat] == ["SmolLM2-135M-Instruct Q4_1", "tiny Q4_K_M"]
    assert "SmolLM2-135M-Instruct.Q4_1" in chat[0].answers_to  # the file's stem, unlisted
    assert chat[0].names == ("SmolLM2-135M-Instruct Q4_1",)
    assert [e.path.name for e in embedding] == ["minilm.gguf"]  # a pooling type: embeddings
    routed = _routed(chat, tmp_path / "states")
    try:
        listed = [m.id for m in routed.openai().models.list()]
        assert listed == ["SmolLM2-135M-Instruct Q4_1", "tiny Q4_K_M"]
        reply = routed.openai().chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
        )  # fmt: skip
        assert reply.model == "SmolLM2-135M-Instruct.Q4_1"
    finally:
        routed.close()
