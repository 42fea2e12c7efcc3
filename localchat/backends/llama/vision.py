"""Images through libmtmd (llama.cpp's multimodal library, llama-cpp-python's ``mtmd_cpp``):
a projector opened beside a loaded language model, a prompt with images cut into chunks at
the media marker, and the chunks evaluated into a context's sequence.

The chunks are evaluated one by one with libmtmd's own helper (``mtmd_helper_eval_chunk_
single``), as llama.cpp's server and ``mtmd-cli`` do: it encodes an image, decodes its
embeddings in batches with the positions the model wants (M-RoPE's 2-D ones where
``mtmd_decode_use_mrope``) and attention made non-causal for the image where
``mtmd_decode_use_non_causal`` (Gemma 3: the whole image must then fit one ubatch). An image
advances the position by its chunk's ``n_pos``, which is less than its ``n_tokens`` under
M-RoPE: positions and KV cells are then no longer the same count.

llama-cpp-python builds libmtmd unless ``-DLLAVA_BUILD=OFF``; ``mtmd_unavailable`` says why
it cannot be loaded where it was built without.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import llama_cpp

from localchat.chat.images import MEDIA_MARKER as MEDIA_MARKER
from localchat.errors import ModelLoadError

CHUNK_TEXT, CHUNK_IMAGE, CHUNK_AUDIO = 0, 1, 2  # enum mtmd_input_chunk_type
# The build whose libmtmd resizes, cuts and encodes images: what kept embeddings came from.
MTMD_VERSION: str = llama_cpp.__version__

# libmtmd's last log lines: it writes to stderr otherwise (every encode says so), and a
# failed load says why only there. Apart from runtime's capture, whose buffer lines count a
# model's memory ("CPU compute buffer size" is a line of clip's too).
_LOG: deque[str] = deque(maxlen=20)


def _log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    _LOG.append(" ".join(text.decode("utf-8", errors="replace").split()))


_capture_log = llama_cpp.llama_log_callback(_log_line)


@cache
def _mtmd() -> ModuleType | str:
    """llama-cpp-python's libmtmd bindings, or why they cannot load (imported on first use:
    the import loads ``libmtmd.so``, which a ``-DLLAVA_BUILD=OFF`` build lacks)."""
    try:
        import llama_cpp.mtmd_cpp as mtmd
    except (OSError, RuntimeError) as error:  # FileNotFoundError: the library was not built
        return (
            f"llama-cpp-python was built without libmtmd ({error}); rebuild it with"
            " pip install --no-cache-dir --force-reinstall llama-cpp-python"
        )
    mtmd.mtmd_helper_log_set(_capture_log, ctypes.c_void_p(0))  # and mtmd's and clip's
    return mtmd


def _last_error() -> str:
    """libmtmd's last error line, for a message."""
    errors = [line for line in _LOG if "error" in line.lower() or "failed" in line.lower()]
    return f": {errors[-1]}" if errors else ""


def mtmd_unavailable() -> str | None:
    """Why libmtmd cannot be used here, or None when it can."""
    found = _mtmd()
    return found if isinstance(found, str) else None


def _lib() -> Any:
    found = _mtmd()
    if isinstance(found, str):
        raise ModelLoadError(found)
    return found


@dataclass(frozen=True)
class Image:
    """One image: an encoded file's bytes (PNG, JPEG, ... as stb_image reads them), or raw
    RGB pixels when ``width`` and ``height`` are given. Its ``key`` names it in the cache."""

    data: bytes
    width: int = 0
    height: int = 0
    # The key of the file these raw pixels were read from (``Projector.pixels``).
    file_key: str = ""

    @property
    def key(self) -> str:
        """The hash of its bytes (and, for raw pixels, its size): the same image is the same
        chunk in every prompt and state, a different one never is."""
        if self.file_key:
            return self.file_key
        digest = hashlib.sha256(self.data)
        if self.width:
            digest.update(f"{self.width}x{self.height}".encode())
        return digest.hexdigest()


@dataclass(frozen=True)
class Chunk:
    """One piece of a tokenized prompt: text (its token ids) or an image (its key)."""

    kind: int
    n_tokens: int  # embeddings (an image) or token ids (text) it puts in the KV cache
    n_pos: int  # positions it advances: an M-RoPE image takes fewer than its n_tokens
    tokens: tuple[int, ...] = ()
    image_key: str = ""


class Projector:
    """A projector (``mmproj`` GGUF) opened for one loaded language model."""

    def __init__(self, path: Path, llm: llama_cpp.Llama, n_threads: int = 2) -> None:
        mtmd = _lib()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        self._marker = MEDIA_MARKER.encode()  # libmtmd keeps the pointer
        params.media_marker = self._marker
        self._llm = llm
        self._ctx = mtmd.mtmd_init_from_file(str(path).encode(), llm.model, params)
        if not self._ctx:
            raise ModelLoadError(f"libmtmd could not load the projector {path}{_last_error()}")
        self.mrope: bool = bool(mtmd.mtmd_decode_use_mrope(self._ctx))
        self.path = path
        self.vision: bool = bool(mtmd.mtmd_support_vision(self._ctx))
        # Whether an image is decoded with non-causal attention (one ubatch for all of it).
        self.non_causal: bool = bool(mtmd.mtmd_decode_use_non_causal(self._ctx, None))
        # Images tokenized alone, being decoded chunk by chunk: their freeing and chunks.
        self._lone: OrderedDict[str, tuple[ExitStack, list[Any]]] = OrderedDict()

    def close(self) -> None:
        """Free libmtmd's context (the language model stays loaded)."""
        for key in list(self._lone):
            self._release(key)
        if self._ctx:
            _lib().mtmd_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> Projector:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @contextmanager
    def tokenized(
        self, text: str, images: Sequence[Image], add_special: bool = True
    ) -> Iterator[Any]:
        """libmtmd's chunks of ``text`` with ``images`` at its markers, one image a marker
        (special tokens parsed; BOS per the vocabulary where ``add_special``), freed on
        leaving."""
        mtmd = _lib()
        bitmaps = [self._bitmap(image) for image in images]
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            raw = text.encode()
            prompt = mtmd.mtmd_input_text(raw, len(raw), add_special, True)
            array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            status = mtmd.mtmd_tokenize(
                self._ctx, chunks, ctypes.byref(prompt), array, len(bitmaps)
            )
            if status != 0:  # 1: markers and images do not pair up; 2: preprocessing failed
                raise ValueError(f"libmtmd could not tokenize the prompt (status {status})")
            yield chunks
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, image: Image) -> Any:
        """libmtmd's bitmap of ``image``, its id the image's key."""
        mtmd = _lib()
        if image.width:
            pixels = (ctypes.c_uint8 * len(image.data)).from_buffer_copy(image.data)
            bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
        else:
            buffer = (ctypes.c_ubyte * len(image.data)).from_buffer_copy(image.data)
            bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(
                self._ctx, buffer, len(image.data), False
            )
        if not bitmap:
            raise ValueError("libmtmd could not read the image")
        mtmd.mtmd_bitmap_set_id(bitmap, image.key.encode())
        return bitmap

    def pixels(self, image: Image) -> Image:
        """``image`` read into raw RGB pixels once (stb_image, as libmtmd reads files), keyed
        as the file: each tokenization then skips decoding the file again."""
        if image.width:
            return image
        mtmd = _lib()
        bitmap = self._bitmap(image)
        try:
            size = int(mtmd.mtmd_bitmap_get_n_bytes(bitmap))
            data = ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), size)
            width = int(mtmd.mtmd_bitmap_get_nx(bitmap))
            height = int(mtmd.mtmd_bitmap_get_ny(bitmap))
        finally:
            mtmd.mtmd_bitmap_free(bitmap)
        return Image(data, width, height, file_key=image.key)

    def chunks(
        self, text: str, images: Sequence[Image] = (), add_special: bool = True
    ) -> list[Chunk]:
        """What ``text`` with ``images`` becomes: its chunks, in order."""
        with self.tokenized(text, images, add_special) as chunks:
            return [_describe(chunks, i) for i in range(_lib().mtmd_input_chunks_size(chunks))]

    def image_tokens(self, image: Image) -> int:
        """How many KV cells ``image``'s embeddings take (all its slices' where it is cut in
        some; a marker alone, so no text is counted: a projector with begin/end-of-image
        tokens puts them in text)."""
        return sum(c.n_tokens for c in self.chunks(MEDIA_MARKER, [image]) if c.kind != CHUNK_TEXT)

    def evaluate(
        self,
        text: str,
        images: Sequence[Image],
        n_past: int,
        seq_id: int = 0,
        n_batch: int = 512,
    ) -> list[int]:
        """Evaluate ``text`` with ``images`` into the model's context after position
        ``n_past``, logits for the last position only; returns the position each chunk
        started at and, last, the position after them all (the new n_past). Bypasses
        ``Llama``'s own token record (``input_ids``, ``n_tokens``): the caller keeps it."""
        mtmd = _lib()
        starts = [n_past]
        with self.tokenized(text, images) as chunks:
            count = mtmd.mtmd_input_chunks_size(chunks)
            pieces = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(count)]
            batches = [self._batch_for(chunk, n_batch) for chunk in pieces]  # refused whole
            for i, (chunk, batch) in enumerate(zip(pieces, batches, strict=True)):
                new_n_past = llama_cpp.llama_pos(starts[-1])  # a text chunk adds to it
                status = mtmd.mtmd_helper_eval_chunk_single(
                    self._ctx, self._llm.ctx, chunk, starts[-1], seq_id,
                    batch, i == count - 1, ctypes.byref(new_n_past),
                )  # fmt: skip
                if status != 0:
                    raise RuntimeError(
                        f"libmtmd could not evaluate chunk {i} (status {status}){_last_error()}"
                    )
                starts.append(new_n_past.value)
        return starts

    def encode(self, image: Image) -> list[bytes]:
        """The embeddings of each of ``image``'s image chunks (its only one, or the
        overview and slices a projector such as Idefics3's cuts it into) as the projector
        encodes them (float32, one row a KV cell), preprocessing included and the language
        model's context untouched: what the bench times."""
        with self.tokenized(MEDIA_MARKER, [image], add_special=False) as chunks:
            return [self._encoded(chunk) for chunk in _image_chunks(chunks)]

    def _encoded(self, chunk: Any) -> bytes:
        """The embeddings of an image ``chunk``, encoded now."""
        mtmd = _lib()
        if mtmd.mtmd_encode_chunk(self._ctx, chunk) != 0:
            raise RuntimeError(f"libmtmd could not encode the image{_last_error()}")
        return ctypes.string_at(mtmd.mtmd_get_output_embd(self._ctx), self._embeddings_size(chunk))

    def _embeddings_size(self, chunk: Any) -> int:
        """Bytes of an image chunk's embeddings: a float32 row of the model's width a cell."""
        n_tokens = int(_lib().mtmd_input_chunk_get_n_tokens(chunk))
        return n_tokens * int(llama_cpp.llama_model_n_embd(self._llm.model)) * 4

    def _lone_image_chunk(self, image: Image, index: int) -> tuple[Any, bool]:
        """Image chunk ``index`` of ``image`` tokenized alone at a marker, and whether it
        is the image's last. An image's chunks are kept until its last is taken (two
        images' at most, the latest): a sliced image is decoded slice by slice, possibly
        beside another's, and each slice would otherwise resize and cut the whole picture
        again."""
        held = self._lone.get(image.key)
        if held is None:
            stack = ExitStack()
            chunks = stack.enter_context(self.tokenized(MEDIA_MARKER, [image], add_special=False))
            held = self._lone[image.key] = (stack, _image_chunks(chunks))
            while len(self._lone) > 2:
                self._lone.popitem(last=False)[1][0].close()
        pieces = held[1]
        if not 0 <= index < len(pieces):
            raise ValueError(
                f"libmtmd made {len(pieces)} image chunks of the image, not {index + 1}"
            )
        return pieces[index], index == len(pieces) - 1

    def _release(self, key: str) -> None:
        """Free the kept chunks of the image ``key`` (nothing where none are kept)."""
        held = self._lone.pop(key, None)
        if held is not None:
            held[0].close()

    def decode_image(
        self,
        image: Image,
        index: int,
        embeddings: bytes | None,
        n_past: int,
        seq_id: int = 0,
        n_batch: int = 512,
        context: Any = None,
    ) -> tuple[int, bytes | None]:
        """Decode image chunk ``index`` of ``image`` into sequence ``seq_id`` of ``context``
        (a llama.cpp context on this projector's model; None: the model's own) at
        ``n_past``, as ``mtmd_helper_eval_chunk_single`` does, without its encode where
        ``embeddings`` are the chunk's (encoded before). Returns the cells it took and the
        embeddings where they were encoded now (None: the ones given were used)."""
        mtmd = _lib()
        target = self._llm.ctx if context is None else context
        chunk, last = self._lone_image_chunk(image, index)
        n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        size = self._embeddings_size(chunk)
        batch = self._batch_for(chunk, n_batch, target)
        encoded = None
        if embeddings is None or len(embeddings) != size:
            embeddings = encoded = self._encoded(chunk)
        floats = (ctypes.c_float * (size // 4)).from_buffer_copy(embeddings)
        new_n_past = llama_cpp.llama_pos(0)
        status = mtmd.mtmd_helper_decode_image_chunk(
            self._ctx, target, chunk, floats, n_past, seq_id, batch,
            ctypes.byref(new_n_past), mtmd.mtmd_helper_post_decode_callback(), None,
        )  # fmt: skip
        if last:
            self._release(image.key)
        if status != 0:
            raise RuntimeError(f"libmtmd could not decode the image (status {status})")
        return n_tokens, encoded

    def refuses(self, n_tokens: int) -> str | None:
        """Why an image of ``n_tokens`` cells cannot be decoded here (None: it can): one
        decoded non-causally must fit one micro-batch."""
        return self._unfit(n_tokens) if self.non_causal else None

    def _unfit(self, n_tokens: int, context: Any = None) -> str | None:
        """Why an image decoded non-causally, of ``n_tokens`` cells, does not fit one
        micro-batch of ``context`` (None: the model's own; None: it fits)."""
        n_ubatch = int(llama_cpp.llama_n_ubatch(self._llm.ctx if context is None else context))
        if n_tokens > n_ubatch:
            return (
                f"{self.path.name} decodes an image whole, in one micro-batch, and this"
                f" one takes {n_tokens} tokens where the micro-batch holds {n_ubatch}"
            )
        return None

    def _batch_for(self, chunk: Any, n_batch: int, context: Any = None) -> int:
        """The batch size to decode ``chunk`` in. An image decoded non-causally must go in
        one batch and one ubatch: libmtmd's helper splits it at ``n_batch`` and llama.cpp at
        ``n_ubatch`` without a word, and each piece then attends only to itself (on the
        generated Gemma 3 projector, an image split in 8s moved the next logits by 0.17)."""
        mtmd = _lib()
        if mtmd.mtmd_input_chunk_get_type(chunk) == CHUNK_TEXT or not (
            mtmd.mtmd_decode_use_non_causal(self._ctx, chunk)
        ):
            return n_batch
        n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        unfit = self._unfit(n_tokens, context)
        if unfit:
            raise ValueError(unfit)
        return max(n_batch, n_tokens)


def _image_chunks(chunks: Any) -> list[Any]:
    """The image chunks of libmtmd's ``chunks``, in order."""
    mtmd = _lib()
    found = [
        mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))
    ]
    return [c for c in found if mtmd.mtmd_input_chunk_get_type(c) == CHUNK_IMAGE]


def _describe(chunks: Any, index: int) -> Chunk:
    """Chunk ``index`` of libmtmd's ``chunks`` as plain data."""
    mtmd = _lib()
    chunk = mtmd.mtmd_input_chunks_get(chunks, index)
    kind = int(mtmd.mtmd_input_chunk_get_type(chunk))
    tokens: tuple[int, ...] = ()
    if kind == CHUNK_TEXT:
        size = ctypes.c_size_t(0)
        ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(size))
        tokens = tuple(int(ids[i]) for i in range(size.value))
    key = mtmd.mtmd_input_chunk_get_id(chunk)
    return Chunk(
        kind=kind,
        n_tokens=int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)),
        n_pos=int(mtmd.mtmd_input_chunk_get_n_pos(chunk)),
        tokens=tokens,
        image_key=key.decode() if key else "",
    )
