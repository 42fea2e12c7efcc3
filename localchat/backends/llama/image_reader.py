"""A loaded model's eyes: its projector, the images it may be shown (by key, from the data
folder's store) and the embeddings it encoded, kept so that no image is encoded twice.

A prompt's rendered text marks each image (``chat.images``); ``tokens`` turns it into
token ids with placeholder runs where the images go (``image_positions``), as libmtmd
tokenizes it (a projector's begin/end-of-image text included). ``evaluate`` decodes one
image's embeddings into the context where its run is: from memory or disk where it was
encoded before (a replay, a branch, another model load), else encoded now.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llama_cpp import Llama

from localchat.atomic import write_atomic
from localchat.backends.llama.image_positions import ImageSource, image_run
from localchat.backends.llama.vision import (
    CHUNK_TEXT,
    MEDIA_MARKER,
    Image,
    Projector,
    mtmd_unavailable,
)
from localchat.chat.images import has_image_markers, split_image_markers
from localchat.errors import ModelLoadError
from localchat.gguf.info import file_fingerprint
from localchat.paths import ensure_private_dir

_HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32
_MAGIC = b"LCIMGEMB"
MEMORY_ENTRIES = 16  # images whose embeddings (and pixels) stay in memory
DISK_BUDGET_BYTES = 1024**3


class EmbeddingStore:
    """Encoded images' embeddings by image key: the latest few in memory, all on disk (one
    private file each, checked on reading, the oldest dropped past the budget) where a
    folder is given. The folder is the projector's own: embeddings depend on it."""

    def __init__(
        self, directory: Path | None, variant: str, budget_bytes: int = DISK_BUDGET_BYTES
    ) -> None:
        self.directory = directory
        self.variant = variant  # the projector's fingerprint: what the embeddings depend on
        self.budget_bytes = budget_bytes
        self._memory: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key]
        data = self._read(key)
        if data is not None:
            self._remember(key, data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self._remember(key, data)
        if self.directory is None:
            return
        ensure_private_dir(self.directory)
        header = _HEADER.pack(_MAGIC, len(data), zlib.crc32(data))
        write_atomic(self._path(key), header + data)
        self._evict()

    def _remember(self, key: str, data: bytes) -> None:
        self._memory[key] = data
        self._memory.move_to_end(key)
        while len(self._memory) > MEMORY_ENTRIES:
            self._memory.popitem(last=False)

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{key}.emb"

    def _read(self, key: str) -> bytes | None:
        """The stored embeddings, or None where there are none or the file is damaged."""
        if self.directory is None:
            return None
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            return None
        if len(raw) < _HEADER.size:
            return None
        magic, size, crc = _HEADER.unpack_from(raw)
        data = raw[_HEADER.size :]
        if magic != _MAGIC or size != len(data) or zlib.crc32(data) != crc:
            return None
        os.utime(self._path(key))  # recently used: evicted last
        return data

    def _evict(self) -> None:
        assert self.directory is not None
        files = sorted(self.directory.glob("*.emb"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files[:-1]:
            if total <= self.budget_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)


def open_reader(
    projector: Path,
    llm: Llama,
    source: ImageSource | None,
    embeddings_dir: Path | None,
    threads: int,
) -> ImageReader:
    """The reader for ``llm`` with the projector ``projector``; refused in one line where
    libmtmd is missing or the projector is one whose images cannot be kept exactly here."""
    unavailable = mtmd_unavailable()
    if unavailable:
        raise ModelLoadError(f"cannot read images with {projector.name}: {unavailable}")
    if source is None:
        raise ValueError("a projector needs the store its images are kept in")
    opened = Projector(projector, llm, threads)
    if opened.mrope:  # n_pos < n_tokens: one position per cell is what the cache keeps
        opened.close()
        raise ModelLoadError(
            f"{projector.name} places images with M-RoPE (the Qwen2-VL family), which"
            " localchat does not read yet; use another vision model"
        )
    if not opened.vision:
        opened.close()
        raise ModelLoadError(f"{projector.name} is not a vision projector (audio only)")
    variant = file_fingerprint(projector)[:32]
    return ImageReader(opened, source, EmbeddingStore(embeddings_dir, variant))


class ImageReader:
    """A projector with the images it may read (``source``) and their embeddings."""

    def __init__(
        self, projector: Projector, source: ImageSource, embeddings: EmbeddingStore
    ) -> None:
        self.projector = projector
        self.source = source
        self.embeddings = embeddings
        self.encodes = 0  # images encoded by the projector (not found in ``embeddings``)
        self._pixels: OrderedDict[str, Image] = OrderedDict()
        self._ids: dict[str, int] = {}  # an id never changes: asked of the store once
        self._keys: dict[int, str] = {}
        # A server tokenizes prompts on its worker threads (libmtmd's tokenizer reads the
        # projector's settings only, as llama.cpp's server runs it): the caches above are
        # shared by them and the compute thread.
        self._lock = threading.Lock()

    def tokens(self, text: str, plain: Callable[[str], list[int]]) -> list[int]:
        """``text``'s token ids (no BOS), images as placeholder runs; text without images
        goes to ``plain``, the model's tokenizer."""
        if not has_image_markers(text):
            return plain(text)
        parts = list(split_image_markers(text))
        keys = [part[0] for part in parts if isinstance(part, tuple)]
        marked = "".join(MEDIA_MARKER if isinstance(part, tuple) else part for part in parts)
        with self._lock:
            images = [self._image(key) for key in keys]
        ids: list[int] = []
        for chunk in self.projector.chunks(marked, images, add_special=False):
            if chunk.kind == CHUNK_TEXT:
                ids.extend(chunk.tokens)
            else:
                with self._lock:
                    image_id = self._id_of(chunk.image_key)
                ids.extend(image_run(image_id, chunk.n_tokens))
        return ids

    def evaluate(
        self, image_id: int, n_past: int, n_batch: int, seq_id: int = 0, context: Any = None
    ) -> int:
        """Decode image ``image_id`` into sequence ``seq_id`` at ``n_past``: of ``context``
        (a server's ``SequenceBatch``), else of the model's own; returns its cells. On the
        compute thread, as every decode."""
        with self._lock:
            image = self._image(self._key_of(image_id))
        n_cells, encoded = self.projector.decode_image(
            image, self.embeddings.get, n_past, seq_id, n_batch, context
        )
        if encoded is not None:
            self.encodes += 1
            self.embeddings.put(image.key, encoded)
        return n_cells

    def _id_of(self, key: str) -> int:
        """The image's placeholder id under this projector: the store's id of the pair, so
        an image read by another projector (other embeddings) never matches a state."""
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = self.source.image_id(key, self.embeddings.variant)
            self._keys[found] = key
        return found

    def _key_of(self, image_id: int) -> str:
        key = self._keys.get(image_id)
        if key is None:
            key = self._keys[image_id] = self.source.key_of_id(image_id)
            self._ids[key] = image_id
        return key

    def _image(self, key: str) -> Image:
        """The image ``key`` as raw pixels, read from the store once."""
        image = self._pixels.get(key)
        if image is None:
            image = self.projector.pixels(Image(self.source.get(key)))
            if image.key != key:
                raise ValueError(f"the stored image {key[:12]} does not hash to its name")
            self._pixels[key] = image
            while len(self._pixels) > MEMORY_ENTRIES:
                self._pixels.popitem(last=False)
        else:
            self._pixels.move_to_end(key)
        return image

    def close(self) -> None:
        self.projector.close()
