"""A loaded model's eyes: its projector, the images it may be shown (by key, from the data
folder's store) and the embeddings it encoded, kept so that no image is encoded twice.

A prompt's rendered text marks each image (``chat.images``); ``tokens`` turns it into
token ids with placeholder runs where the images go (``image_positions``), as libmtmd
tokenizes it (a projector's begin/end-of-image text included). ``evaluate`` decodes one
image's embeddings into the context where its run is: from memory or disk where it was
encoded before (a replay, a branch, another model load), else encoded now.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from localchat.atomic import write_atomic
from localchat.backends.llama.image_positions import (
    ImageSource,
    Tokens,
    image_id_of,
    image_ids_in,
    image_run,
    starts_image,
)
from localchat.backends.llama.recording import RecordingLlama
from localchat.backends.llama.vision import (
    CHUNK_TEXT,
    MEDIA_MARKER,
    MTMD_VERSION,
    Image,
    Projector,
    mtmd_unavailable,
)
from localchat.chat.images import split_image_markers
from localchat.errors import ModelLoadError, UsageError
from localchat.gguf.info import file_fingerprint
from localchat.paths import ensure_private_dir

_HEADER = struct.Struct("<8sQI")  # magic, payload bytes, CRC-32
_MAGIC = b"LCIMGEMB"
MEMORY_ENTRIES = 16  # images whose pixels stay in memory
MEMORY_BYTES = 256 * 2**20  # the embeddings kept in memory, at most (the last always)
PIXEL_BYTES = 64 * 2**20  # the decoded pictures kept in memory, at most (the last one always)
DISK_BUDGET_BYTES = 1024**3
LAYOUTS = 1024  # images whose layout (their ids at a marker) stays in memory


class EmbeddingStore:
    """Encoded images' embeddings by image key (and chunk): the latest in memory, all on
    disk (one private file each, checked on reading, the oldest dropped past the budget)
    where a folder is given. The folder is the projector's own and each file is sealed with
    the libmtmd version that made it: embeddings depend on both (how an image is resized
    and cut is libmtmd's)."""

    def __init__(
        self,
        directory: Path | None,
        variant: str,
        budget_bytes: int = DISK_BUDGET_BYTES,
        made_by: str = MTMD_VERSION,
    ) -> None:
        self.directory = directory
        self.variant = variant  # the projector's fingerprint: what the embeddings depend on
        self.budget_bytes = budget_bytes
        self._seal = zlib.crc32(made_by.encode())  # a file of another version fails its check
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
        """Keep ``data``: on disk at best (a full disk, or another process pruning the
        folder, costs a later encode, never the turn)."""
        self._remember(key, data)
        if self.directory is None:
            return
        header = _HEADER.pack(_MAGIC, len(data), zlib.crc32(data, self._seal))
        try:
            ensure_private_dir(self.directory.parent)
            ensure_private_dir(self.directory)
            write_atomic(self._path(key), header + data)
            self._evict()
        except OSError:
            pass

    def _remember(self, key: str, data: bytes) -> None:
        self._memory[key] = data
        self._memory.move_to_end(key)
        while len(self._memory) > 1 and sum(map(len, self._memory.values())) > MEMORY_BYTES:
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
        if magic != _MAGIC or size != len(data) or zlib.crc32(data, self._seal) != crc:
            return None
        with contextlib.suppress(OSError):
            os.utime(self._path(key))  # recently used: evicted last
        return data

    def _evict(self) -> None:
        assert self.directory is not None
        sizes = {}
        for path in self.directory.glob("*.emb"):
            with contextlib.suppress(OSError):
                found = path.stat()
                sizes[path] = (found.st_mtime, found.st_size)
        total = sum(size for _, size in sizes.values())
        for path in sorted(sizes, key=lambda p: sizes[p][0])[:-1]:
            if total <= self.budget_bytes:
                break
            total -= sizes[path][1]
            path.unlink(missing_ok=True)


def no_projector(model: str) -> str:
    """Why a model without a projector is not shown an image, and what to do."""
    return (
        f"{model} cannot read images: no projector (mmproj GGUF) was found beside it;"
        " give one with --mmproj, or use a vision model"
    )


def open_reader(
    projector: Path,
    llm: RecordingLlama,
    source: ImageSource | None,
    embeddings_dir: Path | None,
    threads: int,
) -> ImageReader:
    """The reader for ``llm`` with the projector ``projector``, set to decode the images
    its evaluations meet; refused in one line where libmtmd is missing or the projector is
    one whose images cannot be kept exactly here."""
    unavailable = mtmd_unavailable()
    if unavailable:
        raise ModelLoadError(f"cannot read images with {projector.name}: {unavailable}")
    if source is None:
        raise ValueError("a projector needs the store its images are kept in")
    opened = Projector(projector, llm, threads)
    if not opened.vision:
        opened.close()
        raise ModelLoadError(f"{projector.name} is not a vision projector (audio only)")
    variant = file_fingerprint(projector)[:32]
    reader = ImageReader(opened, source, EmbeddingStore(embeddings_dir, variant))
    llm.images = reader
    return reader


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
        # An image's ids at its marker, by key: the latest LAYOUTS kept (a server meets
        # images without end; a sliced one's layout is a thousand ids).
        self._layouts: OrderedDict[str, list[int]] = OrderedDict()
        # An id never changes: asked of the store once, by image key and chunk index.
        self._ids: dict[tuple[str, int], int] = {}
        self._slices: dict[int, tuple[str, int]] = {}
        self._behind: dict[int, int] = {}  # an image chunk's cells less its positions, by id
        # A server tokenizes prompts on its worker threads (libmtmd's tokenizer reads the
        # projector's settings only, as llama.cpp's server runs it): the caches above are
        # shared by them and the compute thread.
        self._lock = threading.Lock()

    def tokens(self, text: str, plain: Callable[[str], list[int]]) -> list[int]:
        """``text``'s token ids (no BOS), images as placeholder runs, as libmtmd tokenizes
        it: the text between images by ``plain`` (the model's tokenizer, special tokens
        parsed: libmtmd tokenizes each part apart too), each image as libmtmd lays it out
        at its marker (a projector's begin- and end-of-image tokens around its cells),
        worked out once per image: a prompt's images are not preprocessed on every call."""
        ids: list[int] = []
        for part in split_image_markers(text):
            if isinstance(part, str):
                ids.extend(plain(part))
            else:
                ids.extend(self._layout(part[0]))
        return ids

    def _layout(self, key: str) -> list[int]:
        """What an image becomes at its marker: text ids and its placeholder run, or runs
        where the projector cuts it into slices (Idefics3's, MiniCPM-V's), each its own
        image to the cache with libmtmd's text between them. One whose chunk must be
        decoded whole and does not fit the micro-batch is refused here, before anything is
        stored or decoded."""
        with self._lock:
            found = self._layouts.get(key)
            if found is not None:
                self._layouts.move_to_end(key)
                return found
        # Worked out outside the lock: a large picture takes a second to read, and the
        # compute thread's decodes must not wait for it.
        chunks = self.projector.chunks(MEDIA_MARKER, [self._image(key)], add_special=False)
        layout: list[int] = []
        index = 0
        for chunk in chunks:
            if chunk.kind == CHUNK_TEXT:
                layout.extend(chunk.tokens)
                continue
            refused = self.projector.refuses(chunk.n_tokens)
            if refused:
                raise UsageError(refused)
            image_id = self._id_of(key, index)
            layout.extend(image_run(image_id, chunk.n_tokens))
            with self._lock:
                self._behind[image_id] = chunk.n_tokens - chunk.n_pos
            index += 1
        with self._lock:
            self._layouts[key] = layout
            if len(self._layouts) > LAYOUTS:
                self._layouts.popitem(last=False)
        return layout

    def evaluate(
        self, run: Sequence[int], n_past: int, n_batch: int, seq_id: int = 0, context: Any = None
    ) -> None:
        """Decode the image (or slice) whose placeholder run is ``run`` into sequence
        ``seq_id`` at ``n_past``: of ``context`` (a server's ``SequenceBatch``), else of the
        model's own. ValueError where the run is not one image's whole (the caller cuts the
        cells it left). On the compute thread, as every decode."""
        if not run or not starts_image(run[0]):
            raise ValueError("an image's run must start with its first cell")
        key, index = self._slice_of(image_id_of(run[0]))
        image = self._image(key)
        name = key if index == 0 else f"{key}.{index}"  # the embeddings' name
        n_cells, encoded = self.projector.decode_image(
            image, index, self.embeddings.get(name), n_past, seq_id, n_batch, context
        )
        if encoded is not None:
            self.encodes += 1
            self.embeddings.put(name, encoded)
        if n_cells != len(run):
            raise ValueError(f"an image took {n_cells} cells where its run has {len(run)}")

    @property
    def mrope(self) -> bool:
        """Whether images take fewer positions than cells (M-RoPE: Qwen2-VL's family)."""
        return self.projector.mrope

    def positions_behind(self, tokens: Tokens) -> int:
        """How many fewer positions than cells the images that start in ``tokens`` take:
        under M-RoPE an image's cells share positions (its rows' and columns') and the text
        after it comes after its longer side, as libmtmd's helper places it; 0 for every
        other projector. A cell's position is its index less this, for what precedes it."""
        if not self.projector.mrope:
            return 0
        return sum(self._behind_of(image_id) for image_id in image_ids_in(tokens))

    def _behind_of(self, image_id: int) -> int:
        """Cells less positions of one image chunk: known once it was laid out, else laid
        out again from the store's image (its chunk's ``n_tokens - n_pos``)."""
        with self._lock:
            found = self._behind.get(image_id)
        if found is None:
            key, index = self._slice_of(image_id)
            chunks = self.projector.chunks(MEDIA_MARKER, [self._image(key)], add_special=False)
            chunk = [c for c in chunks if c.kind != CHUNK_TEXT][index]
            found = chunk.n_tokens - chunk.n_pos
            with self._lock:
                self._behind[image_id] = found
        return found

    def _id_of(self, key: str, index: int = 0) -> int:
        """The placeholder id of the image's chunk ``index`` (its only one, or a slice)
        under this projector: the store's id of the three, so an image read by another
        projector (other embeddings) never matches a state."""
        with self._lock:
            found = self._ids.get((key, index))
        if found is None:
            variant = self.embeddings.variant + (f"{index:04x}" if index else "")
            found = self.source.image_id(key, variant)
            with self._lock:
                if len(self._ids) >= LAYOUTS * 32:  # a cache of the store's table: bounded
                    self._ids.clear()
                    self._slices.clear()
                    self._behind.clear()
                self._ids[key, index], self._slices[found] = found, (key, index)
        return found

    def _slice_of(self, image_id: int) -> tuple[str, int]:
        """The image key and chunk index a placeholder id was given to: from the store's
        name of the id (its variant is this projector's fingerprint and the chunk's index)
        where this process has not met it."""
        with self._lock:
            found = self._slices.get(image_id)
        if found is not None:
            return found
        key, variant = self.source.name_of_id(image_id)
        own = self.embeddings.variant
        suffix = variant[len(own) :]
        if not variant.startswith(own) or len(suffix) not in (0, 4):
            raise ValueError(f"image id {image_id} names no image chunk this projector reads")
        found = key, int(suffix or "0", 16)
        with self._lock:
            self._slices[image_id] = found
        return found

    def _image(self, key: str) -> Image:
        """The image ``key`` as raw pixels, read from the store once; the latest kept in
        memory up to ``PIXEL_BYTES`` (a 50-megapixel picture is 150 MB of pixels)."""
        with self._lock:
            image = self._pixels.get(key)
            if image is not None:
                self._pixels.move_to_end(key)
                return image
        image = self.projector.pixels(Image(self.source.get(key)))
        if image.key != key:
            raise ValueError(f"the stored image {key[:12]} does not hash to its name")
        with self._lock:
            self._pixels[key] = image
            while len(self._pixels) > 1 and (
                len(self._pixels) > MEMORY_ENTRIES
                or sum(len(p.data) for p in self._pixels.values()) > PIXEL_BYTES
            ):
                self._pixels.popitem(last=False)
        return image

    def close(self) -> None:
        self.projector.close()
