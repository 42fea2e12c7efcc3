"""Where a message's images go in its rendered text: a marker per image that names it.

A message keeps its images apart from its text (``ChatMessage.images``: each image's key,
the SHA-256 of its bytes, and where in the text it goes: before it unless a client sent
parts in another order); rendering puts one marker per image there, where the template's
polyfills (a system prompt folded into a user turn, turns of one role merged) carry it
along with the text around it. The backend that tokenizes the rendered prompt
turns each marker into the image's positions (libmtmd's chunk, at its media marker, as
llama.cpp's server places it); a backend without images never sees one (``Backend``
refuses a message with images first).

The marker is two private-use characters around the key: nothing a person types, and the
key says which image it is wherever the template moved it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

IMAGE_OPEN = "\U000f0e01"
IMAGE_CLOSE = "\U000f0e02"
# Where an image goes in the text libmtmd tokenizes (its ``media_marker``, set for every
# projector opened here) in place of libmtmd's default ``<__media__>``, which people type.
MEDIA_MARKER = "\U000f0e03"
# A message's own text never carries the three: where one was typed or pasted (they are Nerd
# Font icons), the model reads U+FFFD, and an image is only ever one of the message's own.
_NOT_IN_TEXT = {ord(c): "\ufffd" for c in (IMAGE_OPEN, IMAGE_CLOSE, MEDIA_MARKER)}
_MARKER = re.compile(f"{IMAGE_OPEN}([0-9a-f]{{64}}){IMAGE_CLOSE}")


def image_marker(key: str) -> str:
    """The marker that stands for the image ``key`` in rendered text."""
    return f"{IMAGE_OPEN}{key}{IMAGE_CLOSE}"


def with_image_markers(text: str, images: Sequence[str], at: Sequence[int] = ()) -> str:
    """``text`` with a marker per image where it goes: at its offset in ``at`` (one per
    image, in order), or before the text where ``at`` is empty, with nothing between marker
    and text (as llama.cpp's server and ``mtmd-cli`` write a media marker); the text's own
    marker characters made U+FFFD (``_NOT_IN_TEXT``)."""
    text = text.translate(_NOT_IN_TEXT)  # one character for one: the offsets still hold
    offsets = list(at) or [0] * len(images)
    if len(offsets) != len(images) or offsets != sorted(offsets):
        raise ValueError("an image offset each, in order, is needed")
    pieces, position = [], 0
    for key, offset in zip(images, offsets, strict=True):
        pieces += [text[position:offset], image_marker(key)]
        position = offset
    return "".join(pieces) + text[position:]


# A message's text, its images' keys and where each goes in the text (``joined_parts``).
Joined = tuple[str, tuple[str, ...], tuple[int, ...]]


def joined_parts(parts: Sequence[tuple[str, str]]) -> Joined:
    """A message sent as parts, ``("text", words)`` and ``("image", key)`` in order, as its
    text, its images and where each goes in the text. The text parts are joined
    as llama.cpp's server joins them for a template that takes a string (``concat_content_parts``:
    a newline between two texts, none beside an image or before the first text), so a
    client's prompt is the one llama-server would read."""
    text, keys, at = "", [], []
    after_image = False
    for kind, value in parts:
        if kind == "image":
            keys.append(value)
            at.append(len(text))
            after_image = True
            continue
        if (text or keys) and not after_image:  # llama-server's text holds its markers
            text += "\n"
        text += value
        after_image = False
    return text, tuple(keys), tuple(at)


def image_at_after_cut(
    images: Sequence[str], at: Sequence[int], text: str, kept: str
) -> tuple[int, ...]:
    """Where a message's images go once its ``text`` is cut from its start to ``kept``: each
    as far back as the text was cut, none before the start (an image in the part cut goes
    first), so the images keep their places in the words that remain."""
    removed = len(text) - len(kept)
    offsets = [min(len(kept), max(0, offset - removed)) for offset in list(at) or [0] * len(images)]
    return tuple(offsets) if any(offsets) else ()


def has_image_markers(text: str) -> bool:
    return IMAGE_OPEN in text


def split_image_markers(text: str) -> Iterator[str | tuple[str]]:
    """``text`` as its pieces in order: plain strings, and ``(key,)`` where an image goes."""
    position = 0
    for match in _MARKER.finditer(text):
        if match.start() > position:
            yield text[position : match.start()]
        yield (match.group(1),)
        position = match.end()
    if position < len(text):
        yield text[position:]


def image_keys(text: str) -> list[str]:
    """The keys of the images marked in ``text``, in order."""
    return _MARKER.findall(text)


def openai_parts(
    text: str, images: Sequence[str], at: Sequence[int], url_of: Callable[[str], str]
) -> list[dict[str, object]]:
    """A message's text and images as OpenAI's content parts, each image where it goes
    (``url_of``: an image's key as the URL sent, a data URI): what a server that joins
    parts as llama-server does (no newline beside an image) reads as the text marked here."""
    offsets = list(at) or [0] * len(images)
    parts: list[dict[str, object]] = []
    position = 0
    for key, offset in zip(images, offsets, strict=True):
        if offset > position:
            parts.append({"type": "text", "text": text[position:offset]})
        parts.append({"type": "image_url", "image_url": {"url": url_of(key)}})
        position = offset
    if position < len(text):
        parts.append({"type": "text", "text": text[position:]})
    return parts
