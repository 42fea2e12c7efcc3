"""Where a message's images go in its rendered text: a marker per image that names it.

A message keeps its images apart from its text (``ChatMessage.images``: each image's key,
the SHA-256 of its bytes); rendering puts one marker per image before the text, where the
template's polyfills (a system prompt folded into a user turn, turns of one role merged)
carry it along with the text around it. The backend that tokenizes the rendered prompt
turns each marker into the image's positions (libmtmd's chunk, at its media marker, as
llama.cpp's server places it); a backend without images never sees one (``Backend``
refuses a message with images first).

The marker is two private-use characters around the key: nothing a person types, and the
key says which image it is wherever the template moved it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

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


def with_image_markers(text: str, images: Sequence[str]) -> str:
    """``text`` with a marker per image before it, each on a line of its own (LLaVA's
    ``<image>\\n`` layout, which llama.cpp's server writes for an image part before text);
    the text's own marker characters made U+FFFD (``_NOT_IN_TEXT``)."""
    return "".join(image_marker(key) + "\n" for key in images) + text.translate(_NOT_IN_TEXT)


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
