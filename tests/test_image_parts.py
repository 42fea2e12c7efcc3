"""Where a message's images go in its text: before it (the app, ``ask``, Ollama's
``images``), or where a client put its image parts among its text parts, joined as
llama.cpp's server joins them around a media marker (a newline between two texts, none
beside an image) — on every API that takes parts."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import pytest

from localchat.chat.images import (
    image_at_after_cut,
    image_marker,
    joined_parts,
    with_image_markers,
)
from localchat.chat.template import ChatMessage
from localchat.server.adapters import anthropic, openai_chat, responses
from localchat.server.images import PENDING
from localchat.server.requests import ApiError
from tests.image_helpers import random_png

A, B = "a" * 64, "b" * 64
PNG = "data:image/png;base64," + base64.b64encode(random_png(1)).decode()


def test_images_go_before_the_text_with_nothing_between() -> None:
    """As ``mtmd-cli`` puts a marker before the prompt: no newline of ours after it."""
    assert (
        with_image_markers("What is it?", [A, B])
        == f"{image_marker(A)}{image_marker(B)}What is it?"
    )


def test_images_go_at_their_offsets_and_the_texts_markers_are_not_read_as_images() -> None:
    text = "Compare this \U000f0e01 with that."
    marked = with_image_markers(text, [A, B], [8, 13])
    assert marked == f"Compare {image_marker(A)}this {image_marker(B)}\ufffd with that."
    with pytest.raises(ValueError, match="in order"):
        with_image_markers(text, [A, B], [13, 8])
    with pytest.raises(ValueError, match="an image offset each"):
        with_image_markers(text, [A, B], [3])


def test_parts_are_joined_as_llama_server_joins_them_around_a_media_marker() -> None:
    parts = [("text", "First"), ("text", "second"), ("image", A), ("text", "third"),
             ("image", B), ("image", A), ("text", "last")]  # fmt: skip
    text, keys, at = joined_parts(parts)
    assert text == "First\nsecondthirdlast"
    assert keys == (A, B, A) and at == (12, 17, 17)
    rendered = with_image_markers(text, keys, at)
    assert rendered == (
        f"First\nsecond{image_marker(A)}third{image_marker(B)}{image_marker(A)}last"
    )
    # A text after an image and an empty text: the newline llama-server writes there.
    assert joined_parts([("image", A), ("text", ""), ("text", "b")]) == ("\nb", (A,), (0,))
    # Without images too: a newline between two texts, none before the first.
    assert joined_parts([("text", "a"), ("text", "b")]) == ("a\nb", (), ())
    assert joined_parts([("text", ""), ("text", "b"), ("text", "")]) == ("b\n", (), ())


def test_a_message_renders_its_images_where_they_were_sent() -> None:
    message = ChatMessage("user", "Look at this and say.", images=(A,), image_at=(12,))
    assert message.with_markers().content == f"Look at this{image_marker(A)} and say."
    assert message.with_markers().images == () and message.with_markers().image_at == ()


def _user(messages: list[ChatMessage]) -> ChatMessage:
    (said,) = [m for m in messages if m.role == "user"]
    return said


def _openai(content: list[dict[str, Any]]) -> ChatMessage:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    request = openai_chat.parse_request(body, chat=True)
    assert request.messages is not None
    return _user(request.messages)


def test_text_parts_without_images_read_as_llama_server_reads_them() -> None:
    """Claude Code sends a user turn as several text blocks (reminders, then the words):
    joined by a newline, as llama-server joins them, on every API that takes parts."""
    said = _openai([{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Hi"}])
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Hi"}]}]}  # fmt: skip
    claude = anthropic.parse_request(body).messages
    items = [{"role": "user", "content": [{"type": "input_text", "text": "<reminder>"},
                                          {"type": "input_text", "text": "Hi"}]}]  # fmt: skip
    asked = responses.parse_request({"model": "m", "input": items}, None).request.messages
    assert claude is not None and asked is not None
    assert said.content == _user(claude).content == _user(asked).content == "<reminder>\nHi"


def test_every_api_keeps_its_image_parts_where_they_were_sent() -> None:
    image = {"type": "image_url", "image_url": {"url": PNG}}
    said = _openai([{"type": "text", "text": "Before"}, image, {"type": "text", "text": "after"}])
    assert (said.content, said.images, said.image_at) == ("Beforeafter", (f"{PENDING}0",), (6,))

    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "One"}, {"type": "text", "text": "two"}, block,
        {"type": "text", "text": "three"}]}]}  # fmt: skip
    request = anthropic.parse_request(body)
    assert request.messages is not None
    claude = _user(request.messages)
    assert (claude.content, claude.image_at) == ("One\ntwothree", (7,))

    items = [{"role": "user", "content": [
        {"type": "input_text", "text": "Is"}, {"type": "input_image", "image_url": PNG},
        {"type": "input_text", "text": "it?"}]}]  # fmt: skip
    kept = responses.parse_request({"model": "m", "input": items}, None)
    assert kept.request.messages is not None
    asked = _user(kept.request.messages)
    assert (asked.content, len(asked.images), asked.image_at) == ("Isit?", 1, (2,))


def test_a_tool_results_image_goes_where_the_result_has_it() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}  # fmt: skip
    result = {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
              "content": [{"type": "text", "text": "Shot"}, image]}  # fmt: skip
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {}}]},
        {"role": "user", "content": [result]}]}  # fmt: skip
    messages = anthropic.parse_request(body).messages
    assert messages is not None
    tool = messages[-1]
    assert (tool.role, tool.content, tool.image_at) == ("tool", "Error: Shot", (11,))
    assert tool.images == (f"{PENDING}0",)
    # Text only: its blocks run together, as llama-server runs a tool result's text.
    result["content"] = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    result["is_error"] = False
    assert (anthropic.parse_request(body).messages or [])[-1].content == "ab"


def test_a_function_call_outputs_image_goes_where_the_output_has_it() -> None:
    items = [
        {"role": "user", "content": "Look"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "Taken:"}, {"type": "input_image", "image_url": PNG}]},
    ]  # fmt: skip
    messages = responses.parse_request({"model": "m", "input": items}, None).request.messages
    assert messages is not None
    tool = messages[-1]
    assert (tool.role, tool.content, tool.image_at) == ("tool", "Taken:", (6,))
    items[-1]["output"] = [{"type": "input_file", "file_id": "f"}]
    with pytest.raises(ApiError, match=r"input\[2\]\.output\[0\]: input_file is not read"):
        responses.parse_request({"model": "m", "input": items}, None)


def test_an_openai_tool_message_may_answer_with_a_picture_an_assistant_may_not() -> None:
    image = {"type": "image_url", "image_url": {"url": PNG}}
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Shot:"}, image]},
    ]}  # fmt: skip
    messages = openai_chat.parse_request(body, chat=True).messages
    assert messages is not None
    assert (messages[-1].role, messages[-1].content, messages[-1].image_at) == (
        "tool",
        "Shot:",
        (5,),
    )
    body["messages"][1]["content"] = [image]
    with pytest.raises(ApiError, match=r"messages\[1\]: images go in user or tool messages"):
        openai_chat.parse_request(body, chat=True)


def test_a_message_cut_for_a_servers_context_keeps_its_images() -> None:
    """The remote window cuts text only: an image is never sent without, and a message
    whose images alone do not fit is refused saying so."""
    from localchat.backends.remote import IMAGE_TOKENS_GUESS
    from localchat.conversation.remote import _cut_text
    from localchat.errors import UsageError

    message = ChatMessage("user", "word " * 100, images=(A,), image_at=(5,))
    tokens = 100 + IMAGE_TOKENS_GUESS
    cut = _cut_text(message, 50, tokens)
    # The image was in the part cut: it goes first, and the words after it stay.
    assert cut.images == (A,) and cut.image_at == () and 0 < len(cut.content) < 500
    late = replace(message, image_at=(450,))  # near the end: it keeps its place
    kept = _cut_text(late, 50, tokens)
    assert kept.image_at == (450 - (500 - len(kept.content)),)
    assert kept.with_markers().content.endswith(f"word {image_marker(A)}{'word ' * 10}")
    with pytest.raises(UsageError, match=r"image\(s\) take more of the server's context"):
        _cut_text(message, 100, tokens)


def test_an_images_place_moves_back_with_the_text_cut_before_it() -> None:
    text, kept = "0123456789", "56789"
    assert image_at_after_cut([A, B], [2, 7], text, kept) == (0, 2)
    assert image_at_after_cut([A], [], text, kept) == ()  # first: stays first
    assert image_at_after_cut([A], [10], text, kept) == (5,)  # at the end: stays last
    assert image_at_after_cut([A], [3], text, kept) == ()  # in the part cut: goes first
