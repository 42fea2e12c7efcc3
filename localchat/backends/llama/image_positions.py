"""An image's positions in the token lists the cache is kept by.

An image takes KV cells like tokens do, but has no token ids: libmtmd decodes its
embeddings there. Every list of ids the project keeps (the cache's own, a saved state's,
the prompt cache's hashed blocks, the draft's look-up) stands for them with placeholder
ids: negative, so llama.cpp never sees one, and derived from the image's persistent id in
the data folder (``ImageSource.image_id``, never reused), so equal ids are the same image
and the bookkeeping that compares ids (common prefixes, state names, block hashes) stays
exact with images in it. An image's first cell is ``-2·id`` and the rest ``-(2·id + 1)``:
two copies of one image side by side are two runs, and a cut that would fall inside an
image is visible.

A cell's position is its index, except after an image placed with M-RoPE (Qwen2-VL's
family): its cells share positions (its rows' and columns') and the text after it comes
after its longer side, so every later position is its index less what such images before
it take fewer (``ImageDecoder.positions_behind``). The lists stay lists of cells; only
what is handed to llama.cpp as a position is shifted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

# A token list: a list, or llama-cpp-python's array of the cached ids (``input_ids``).
Tokens = Sequence[int] | npt.NDArray[np.intc]


class ImageSource(Protocol):
    """Where images are kept, by key (the SHA-256 of their bytes): the data folder's store.
    An id names the image as one projector reads it (``variant``: its fingerprint, and which
    of its image chunks where it is read in slices); ``name_of_id`` gives both back."""

    def get(self, key: str) -> bytes: ...

    def image_id(self, key: str, variant: str = "") -> int: ...

    def name_of_id(self, image_id: int) -> tuple[str, str]: ...


class ImageDecoder(Protocol):
    """What decodes an image's embeddings into the context (``image_reader.ImageReader``);
    ``encodes``: the images it had to encode (not found already encoded);
    ``positions_behind``: how many fewer positions than cells the images of a token list
    take (M-RoPE's; 0 elsewhere), what a cell's position is its index less."""

    encodes: int

    def evaluate(self, run: Sequence[int], n_past: int, n_batch: int) -> None: ...

    def positions_behind(self, tokens: Tokens) -> int: ...


def image_run(image_id: int, n_cells: int) -> list[int]:
    """The placeholder ids of an image that takes ``n_cells`` cells."""
    return [-2 * image_id] + [-(2 * image_id + 1)] * (n_cells - 1)


def starts_image(token: int) -> bool:
    """Whether ``token`` is an image's first cell."""
    return token < 0 and token % 2 == 0


def image_id_of(token: int) -> int:
    """The image a placeholder id stands for."""
    return (-token) // 2


def placeholder_bytes(token: int) -> bytes:
    """What a placeholder spells where token lists are compared by their text: an image's
    first cell names the image, the rest nothing (two images never read alike)."""
    if not starts_image(token):
        return b""
    return f"\U000f0e01#{image_id_of(token)}\U000f0e02".encode()


def image_ids_in(tokens: Tokens) -> list[int]:
    """The ids of the images that start in ``tokens``, in order (a numpy scan: a list as
    long as the context is scanned on every token generated after an M-RoPE image)."""
    ids = np.asarray(tokens, dtype=np.int64)
    firsts = ids[(ids < 0) & (ids % 2 == 0)]
    return [int(t) // -2 for t in firsts]


def has_images(tokens: Sequence[int]) -> bool:
    return bool(len(tokens)) and min(tokens) < 0


def image_starts(tokens: Sequence[int]) -> tuple[int, ...]:
    """Where each image in ``tokens`` starts."""
    if not has_images(tokens):
        return ()
    return tuple(i for i, t in enumerate(tokens) if starts_image(t))


@dataclass(frozen=True)
class Piece:
    """A stretch of a token list: text ids, or one image's run (``image_id`` > 0)."""

    start: int
    tokens: Sequence[int]
    image_id: int = 0


def pieces(tokens: Sequence[int], offset: int = 0) -> Iterator[Piece]:
    """``tokens`` as text stretches and image runs, in order (positions from ``offset``).
    A run that does not start with an image's first cell is a cut image: ValueError."""
    i, n = 0, len(tokens)
    while i < n:
        j = i
        if tokens[i] >= 0:
            while j < n and tokens[j] >= 0:
                j += 1
            yield Piece(offset + i, tokens[i:j])
        else:
            if not starts_image(tokens[i]):
                raise ValueError(f"position {offset + i} is inside an image, not its start")
            j = image_end(tokens, i)
            yield Piece(offset + i, tokens[i:j], image_id_of(tokens[i]))
        i = j


def image_end(tokens: Sequence[int], start: int) -> int:
    """Where the image whose first cell is ``tokens[start]`` ends (its later cells are all
    one id; the list's end where it is cut there)."""
    rest, end = tokens[start] - 1, start + 1
    while end < len(tokens) and tokens[end] == rest:
        end += 1
    return end


def batch_starts(tokens: Sequence[int], begin: int, end: int, size: int) -> list[int]:
    """Where the batches that evaluate ``tokens[begin:end]`` start, as ``RecordingLlama``
    evaluates and records them: text in batches of ``size`` from each stretch's start, each
    image whole in one (a batch never ends inside an image). Without images,
    ``range(begin, end, size)``."""
    starts: list[int] = []
    for piece in pieces(tokens[begin:end], begin):
        if piece.image_id:
            starts.append(piece.start)
        else:
            starts.extend(range(piece.start, piece.start + len(piece.tokens), size))
    return starts


def image_start_before(tokens: Tokens, position: int) -> int:
    """Where the image that ``position`` falls inside starts (``position`` itself where it
    is not inside one): a cut is moved back there, never into an image."""
    if not 0 < position < len(tokens) or tokens[position] >= 0 or starts_image(tokens[position]):
        return position
    start = position - 1
    while start > 0 and not starts_image(tokens[start]):
        start -= 1
    return start
