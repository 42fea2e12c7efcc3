"""``serve`` reading images, through the official clients of every API, on the generated LM
with a generated projector beside it: each API takes an image and answers, a model without
a projector and a bad image are refused in one line, and the prompt cache keeps images —
the same image resent (also to a restarted server) is not decoded again, a different one
with the same text is. Skipped where llama-cpp-python was built without libmtmd."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from localchat.backends.base import Sampling
from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.engine import Engine
from localchat.backends.llama.vision import mtmd_unavailable
from localchat.backends.remote import RemoteBackend
from localchat.chat.image_files import inspect_image
from localchat.chat.template import ChatMessage
from localchat.models.launch import LaunchOptions
from localchat.models.loader import ModelLoader
from localchat.paths import app_paths
from localchat.server.app import BackgroundServer
from localchat.server.images import image_store
from localchat.server.requests import GenerationRequest
from localchat.server.router import Router
from localchat.server.runner import ModelRunner
from localchat.state.images import image_key
from localchat.state.kvstate import StateStore
from tests.image_helpers import random_png, vision_model_with

pytestmark = pytest.mark.skipif(
    mtmd_unavailable() is not None, reason=mtmd_unavailable() or "libmtmd loads"
)

NAME = "tiny-vision"
# Long enough that the prompt passes a cache block (64 tokens) after the image.
LOOK = "Describe this picture in detail, every colour and shape you can see in it. " * 3


@pytest.fixture(scope="module")
def vision_model(models_dir: Path) -> Path:
    return vision_model_with(models_dir)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Served:
    """The vision model behind a real uvicorn server, loaded as ``serve`` loads it."""

    def __init__(self, model: Path, states: Path, projector: str | None = None) -> None:
        launch = LaunchOptions(
            n_ctx=1024, n_threads=2, lookup_only=True, own_cells=256, projector=projector
        )
        self.engine = run_compute(ModelLoader(app_paths()).load, model, launch)
        self.runner = ModelRunner(self.engine, StateStore(states), NAME, parallel=2)
        self.server = BackgroundServer(Router.of_one(self.runner))
        self.root = self.server.root

    def close(self) -> None:
        self.server.close()
        self.runner.close()
        run_compute(self.engine.close)


@pytest.fixture
def served(vision_model: Path, tmp_path: Path) -> Iterator[Served]:
    server = Served(vision_model, tmp_path / "states")
    yield server
    server.close()


def _openai(root: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0)


def _ask(
    root: str, picture: bytes, text: str = LOOK, max_tokens: int = 4
) -> openai.types.chat.ChatCompletion:
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(picture)}"}},
        {"type": "text", "text": text},
    ]
    return _openai(root).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item, misc]
        temperature=0,
        max_tokens=max_tokens,
    )


def _cached(reply: openai.types.chat.ChatCompletion) -> int:
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def _image_span(served: Served, picture: bytes, text: str = LOOK) -> tuple[int, int]:
    """Where the picture's cells start and end in the prompt of ``_ask``."""
    message = ChatMessage("user", text, images=(image_key(picture),))
    tokens = served.runner.prompt_ids(_request(message))
    cells = [i for i, t in enumerate(tokens) if t < 0]
    return cells[0], cells[-1] + 1


def _request(message: ChatMessage) -> GenerationRequest:
    return GenerationRequest(NAME, [message], None, Sampling(), None)


def test_every_api_reads_an_image_and_the_model_says_it_sees(served: Served) -> None:
    picture = random_png(1)
    reply = _ask(served.root, picture)
    assert reply.choices[0].message.content is not None and reply.usage is not None
    start, end = _image_span(served, picture)
    assert reply.usage.prompt_tokens > end > start  # the image's cells are in the prompt
    claude = anthropic.Anthropic(base_url=served.root, api_key="none", max_retries=0)
    message = claude.messages.create(
        model=NAME,
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": _b64(random_png(2)),
                        },
                    },
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    )
    assert message.usage.input_tokens > end - start and message.content
    client = ollama.Client(host=served.root)
    chat = client.chat(
        model=NAME,
        messages=[{"role": "user", "content": "What is this?", "images": [_b64(random_png(3))]}],
        options={"temperature": 0, "num_predict": 4},
    )
    assert chat.done and chat.prompt_eval_count and chat.prompt_eval_count > end - start
    generated = client.generate(
        model=NAME, prompt="What is this?", images=[random_png(4)], options={"num_predict": 4}
    )
    assert (
        generated.done and generated.prompt_eval_count and generated.prompt_eval_count > end - start
    )
    response = _openai(served.root).responses.create(
        model=NAME,
        max_output_tokens=4,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {
                        "type": "input_image",
                        "image_url": f"data:image/png;base64,{_b64(random_png(5))}",
                        "detail": "auto",
                    },
                ],
            }
        ],  # type: ignore[list-item]
    )
    assert response.usage is not None and response.usage.input_tokens > end - start
    # A continuation by previous_response_id keeps the image (the kept conversation holds it).
    follow = _openai(served.root).responses.create(
        model=NAME, max_output_tokens=4, input="And?", previous_response_id=response.id
    )
    assert follow.usage is not None and follow.usage.input_tokens > response.usage.input_tokens
    # Every image stored once, content-addressed; each encoded once by the projector.
    assert len(list(app_paths().images_dir.glob("??/*.json"))) == 5
    assert served.engine.image_reader is not None and served.engine.image_reader.encodes == 5
    # The listings say the model reads images.
    assert httpx.get(f"{served.root}/props").json()["modalities"]["vision"] is True
    assert "vision" in client.show(NAME).capabilities  # type: ignore[operator]


def test_an_image_a_tool_returned_is_read_where_the_result_has_it(served: Served) -> None:
    """Claude Code's Read tool answers an image file with an image block in its tool_result:
    the model reads that image (encoded once), as llama-server reads it."""
    picture = random_png(6)
    claude = anthropic.Anthropic(base_url=served.root, api_key="none", max_retries=0)
    shown = {"type": "base64", "media_type": "image/png", "data": _b64(picture)}
    read = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "shot.png"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "image", "source": shown}]}  # fmt: skip
    messages: Any = [
        {"role": "user", "content": "What is in shot.png?"},
        {"role": "assistant", "content": [read]},
        {"role": "user", "content": [result]},
    ]
    reader: Any = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}
    message = claude.messages.create(
        model=NAME,
        max_tokens=4,
        tools=[reader],
        messages=messages,
    )
    start, end = _image_span(served, picture)
    assert message.usage.input_tokens > end - start and message.content
    assert served.engine.image_reader is not None and served.engine.image_reader.encodes == 1
    # The Responses API's function_call_output takes it too: the same picture, not encoded again.
    items: Any = [
        {"role": "user", "content": "What is in shot.png?"},
        {"type": "function_call", "call_id": "c1", "name": "Read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": f"data:image/png;base64,{_b64(picture)}"}]},
    ]  # fmt: skip
    response = _openai(served.root).responses.create(model=NAME, max_output_tokens=4, input=items)
    items[-1]["output"] = ""  # the same turn without the picture: its cells fewer
    bare = _openai(served.root).responses.create(model=NAME, max_output_tokens=4, input=items)
    assert response.usage is not None and bare.usage is not None
    assert response.usage.input_tokens - bare.usage.input_tokens >= end - start
    assert served.engine.image_reader.encodes == 1
    assert len(list(app_paths().images_dir.glob("??/*.json"))) == 1


def test_a_phone_sized_photo_is_taken(served: Served) -> None:
    """A 10 MB picture (14 MB in base64) fits the body a request may have."""
    photo = random_png(51, (2000, 1800))
    assert len(photo) > 10 * 2**20
    reply = _ask(served.root, photo)
    assert reply.usage is not None and reply.usage.prompt_tokens > 0


def test_bad_images_and_urls_are_refused_naming_the_field(served: Served) -> None:
    def refused(url: str) -> str:
        with pytest.raises(openai.BadRequestError) as caught:
            _openai(served.root).chat.completions.create(
                model=NAME,
                messages=[
                    {
                        "role": "user",
                        "content": [  # type: ignore[list-item, misc]
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": url}},
                        ],
                    }
                ],
                max_tokens=2,
            )
        message = str(caught.value.body["message"])  # type: ignore[index]
        assert "\n" not in message
        return message

    assert "messages[0].content[1].image_url is not an image" in refused(
        f"data:image/png;base64,{_b64(b'hello, not a picture')}"
    )
    assert "is not valid base64" in refused("data:image/png;base64,@@@@")
    assert "does not fetch images from URLs" in refused("https://example.com/cat.png")
    assert "data URI" in refused("cat.png")
    claude = anthropic.Anthropic(base_url=served.root, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=r"content\[0\]\.source: this server"):
        claude.messages.create(
            model=NAME,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://example.com/a.png"},
                        },
                    ],
                }
            ],
        )
    with pytest.raises(ollama.ResponseError, match=r"messages\[0\]\.images\[0\] opens like"):
        ollama.Client(host=served.root).chat(
            model=NAME, messages=[{"role": "user", "content": "?", "images": [_b64(b"GIF89a")]}]
        )


def test_a_model_without_a_projector_refuses_an_image_in_one_line(
    vision_model: Path, tmp_path: Path
) -> None:
    served = Served(vision_model, tmp_path / "states", projector="none")
    remote = RemoteBackend(f"{served.root}/v1", NAME)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            _ask(served.root, random_png(1))
        message = str(caught.value.body["message"])  # type: ignore[index]
        assert "cannot read images" in message and "\n" not in message
        assert httpx.get(f"{served.root}/props").json()["modalities"]["vision"] is False
        capabilities = ollama.Client(host=served.root).show(NAME).capabilities or []
        assert "vision" not in capabilities
        # localchat pointed at it refuses an image before sending it, saying why.
        assert "reads no images" in (remote.images_refused() or "")
    finally:
        remote.close()
        served.close()


def test_localchat_pointed_at_a_server_sends_images_where_they_are_in_the_message(
    served: Served, vision_model: Path
) -> None:
    """The remote backend sends a message's images as data URIs, in their places: the reply
    is the one the engine gives the same message here."""
    picture = random_png(41)
    key = image_store().put(inspect_image(picture, "p.png")).key
    message = ChatMessage("user", "Look at this and say.", images=(key,), image_at=(12,))
    remote = RemoteBackend(f"{served.root}/v1", NAME)
    try:
        assert remote.images_refused() is None
        reply = remote.stream([message], Sampling(temperature=0.0), 8)
        said = "".join(delta.text for delta in reply)
    finally:
        remote.close()
    engine = run_compute(
        ModelLoader(app_paths()).load, vision_model, LaunchOptions(n_ctx=1024, n_threads=2)
    )
    try:
        assert said == run_compute(_greedy, engine, message, 8)
        moved = ChatMessage("user", message.content, images=(key,))  # before the text
        assert engine.prompt_tokens([moved]) != engine.prompt_tokens([message])
    finally:
        run_compute(engine.close)


# And the image chunks each reads an image in; Qwen2-VL's places it with M-RoPE.
SHAPES = [("vit-tiny", 1), ("idefics3-tiny", 5), ("qwen2vl-tiny", 1)]


@pytest.mark.parametrize(("shape", "chunks"), SHAPES)
def test_the_same_image_resent_is_cached_a_different_one_is_not_also_after_a_restart(
    models_dir: Path, tmp_path: Path, shape: str, chunks: int
) -> None:
    """Also where an image is read as an overview and slices (Idefics3's projector)."""
    vision_model = vision_model_with(models_dir, shape)
    states = tmp_path / "states"
    picture, other = random_png(11), random_png(12)
    served = Served(vision_model, states)
    try:
        first = _ask(served.root, picture)
        assert _cached(first) == 0
        start, end = _image_span(served, picture)
        again = _ask(served.root, picture)  # in memory: the image is not decoded again
        assert _cached(again) >= end and _cached(again) == again.usage.prompt_tokens - 1  # type: ignore[union-attr]
        assert again.choices[0].message.content == first.choices[0].message.content
        different = _ask(served.root, other)  # the same text around another image
        assert _cached(different) <= start
        reader = served.engine.image_reader
        assert reader is not None and reader.encodes == 2 * chunks
        served.runner.saver.wait()
    finally:
        served.close()
    restarted = Served(vision_model, states)  # its sequences empty: only the disk holds it
    try:
        assert len(restarted.runner.cache) >= 2
        resent = _ask(restarted.root, picture)
        assert _cached(resent) >= end  # restored from the state saved before the restart
        print(f"image cells {start}-{end}; resent after restart: {_cached(resent)} cached"
              f" of {resent.usage.prompt_tokens}")  # type: ignore[union-attr]  # fmt: skip
        assert resent.choices[0].message.content == first.choices[0].message.content
        assert restarted.engine.image_reader is not None
        assert restarted.engine.image_reader.encodes == 0  # nothing of the image decoded
        assert (
            "localchat:prompt_tokens_restored_total 0"
            not in httpx.get(f"{restarted.root}/metrics").text
        )
        new = _ask(restarted.root, random_png(13))
        assert _cached(new) <= start
    finally:
        restarted.close()


def test_served_images_nothing_refers_to_are_swept_and_a_resent_one_still_hits_the_cache(
    served: Served,
) -> None:
    """Nothing keeps a served image after its request: the store is swept as images come
    in (hourly), and the same image resent is stored again under its old id."""
    from localchat.server.images import SERVED_KEEP_S, sweep_if_due

    picture = random_png(31)
    first = _ask(served.root, picture)
    served.runner.saver.wait()
    key = image_key(picture)
    store = image_store()
    assert store.find(key) is not None
    assert sweep_if_due(every_s=0) == []  # sent just now: its request may still be reading it
    old = time.time() - 2 * SERVED_KEEP_S
    os.utime(store.path(key), (old, old))
    assert sweep_if_due() == []  # swept when the server stored its first image: not due
    assert sweep_if_due(every_s=0) == [key] and store.find(key) is None
    again = _ask(served.root, picture)
    assert _cached(again) == again.usage.prompt_tokens - 1  # type: ignore[union-attr]
    assert again.choices[0].message.content == first.choices[0].message.content
    assert store.find(key) is not None


@pytest.mark.parametrize(("shape", "chunks"), SHAPES)
def test_two_images_read_side_by_side_are_each_the_reply_alone(
    models_dir: Path, tmp_path: Path, shape: str, chunks: int
) -> None:
    """Each image is decoded into its own sequence: two requests at once get the replies
    the engine's own context gives each alone (``ask``'s path), also an image in slices
    (read a slice a step, beside the other request's)."""
    vision_model = vision_model_with(models_dir, shape)
    pictures = [random_png(21), random_png(22)]
    served = Served(vision_model, tmp_path / "states")
    try:
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda p: _ask(served.root, p, max_tokens=8), pictures))
        reader = served.engine.image_reader
        assert reader is not None and reader.encodes == 2 * chunks
    finally:
        served.close()
    engine = run_compute(
        ModelLoader(app_paths()).load, vision_model, LaunchOptions(n_ctx=1024, n_threads=2)
    )
    try:
        for picture, reply in zip(pictures, replies, strict=True):
            message = ChatMessage("user", LOOK, images=(image_key(picture),))
            alone = run_compute(_greedy, engine, message, 8)
            assert reply.choices[0].message.content == alone
    finally:
        run_compute(engine.close)


def _greedy(engine: Engine, message: ChatMessage, max_tokens: int) -> str:
    generation = engine.generate(
        engine.prompt_tokens([message]), Sampling(temperature=0.0), max_tokens
    )
    for _ in generation:
        pass
    return generation.text
