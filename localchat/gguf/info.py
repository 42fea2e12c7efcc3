"""Read a GGUF header — architecture numbers and tensor sizes — without loading weights.

The parser reads sequentially from a ``ByteSource`` so the same code serves a local file and
(later) a file on the hub read with HTTP range requests. Every length read from the file is
bounded before it is used, so a header that lies about sizes gives an error, never a crash or
a huge allocation.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from localchat.errors import ModelFileError
from localchat.gguf.names import display_name
from localchat.gguf.quants import FILE_TYPE_IDS, GGML_BLOCKS, GGML_TYPE_IDS
from localchat.text import shown

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Bounds on what a sane header holds; anything beyond is treated as a corrupt file.
MAX_STRING_BYTES = 64 * 1024 * 1024
MAX_ARRAY_ITEMS = 16 * 1024 * 1024
MAX_KV_COUNT = 1_000_000
MAX_TENSOR_COUNT = 1_000_000
MAX_DIMS = 8
# Arrays longer than this are counted, not kept (token lists, merges).
KEPT_ARRAY_ITEMS = 64

_SCALAR_FORMATS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9


class ByteSource(Protocol):
    """Sequential reader over a GGUF file's bytes."""

    def read(self, n: int) -> bytes: ...

    def size(self) -> int | None: ...


class FileSource:
    """A local file, read in buffered sequential chunks."""

    def __init__(self, path: Path) -> None:
        self._handle = path.open("rb")
        self._size = path.stat().st_size

    def read(self, n: int) -> bytes:
        return self._handle.read(n)

    def size(self) -> int | None:
        return self._size

    def close(self) -> None:
        self._handle.close()


# Fetch ``length`` bytes at ``start`` of a remote file: (the bytes, the file's size if known).
# The hub module supplies it (huggingface_hub's session: token, proxies, retries, offline).
RangeFetch = Callable[[int, int], tuple[bytes, int | None]]


class HttpRangeSource:
    """A remote file read with HTTP range requests, a chunk at a time: planning a download
    costs the header's bytes, not the model's."""

    CHUNK = 1024 * 1024

    def __init__(self, fetch: RangeFetch) -> None:
        self._fetch_range = fetch
        self._buffer = b""
        self._buffer_start = 0
        self._position = 0
        self._size: int | None = None
        self.requests = 0

    def _fetch(self, start: int, length: int) -> bytes:
        self.requests += 1
        data, size = self._fetch_range(start, length)
        if size is not None:
            self._size = size
        return data[:length]

    def read(self, n: int) -> bytes:
        end = self._position + n
        buffered_end = self._buffer_start + len(self._buffer)
        if end > buffered_end:
            self._buffer = self._fetch(self._position, max(n, self.CHUNK))
            self._buffer_start = self._position
        offset = self._position - self._buffer_start
        data = self._buffer[offset : offset + n]
        self._position += len(data)
        return data

    def size(self) -> int | None:
        return self._size


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int
    n_bytes: int

    @property
    def layer(self) -> int | None:
        """The block index of ``blk.N.*`` tensors; None for embeddings, output and norms."""
        parts = self.name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
            return int(parts[1])
        return None


@dataclass(frozen=True)
class GGUFInfo:
    """What localchat needs to know about a model before (or without) loading it."""

    source: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def name(self) -> str:
        """``general.name``: often a training run's label; shown only where a file has no
        name of its own (``display_name``)."""
        return str(self.metadata.get("general.name", Path(self.source).stem))

    @property
    def display_name(self) -> str:
        """The name users know the model by: its repository's or its file's."""
        return display_name(self.source, fallback=self.name)

    @property
    def n_layer(self) -> int:
        return int(self.arch_value("block_count", 0))

    @property
    def n_embd(self) -> int:
        return int(self.arch_value("embedding_length", 0))

    @property
    def n_head(self) -> int:
        return _first_int(self.arch_value("attention.head_count", 0))

    @property
    def n_head_kv(self) -> int:
        return _first_int(self.arch_value("attention.head_count_kv", self.n_head))

    @property
    def head_dim_k(self) -> int:
        default = self.n_embd // self.n_head if self.n_head else 0
        return int(self.arch_value("attention.key_length", default))

    @property
    def head_dim_v(self) -> int:
        default = self.n_embd // self.n_head if self.n_head else 0
        return int(self.arch_value("attention.value_length", default))

    @property
    def context_length(self) -> int:
        return int(self.arch_value("context_length", 0))

    @property
    def sliding_window(self) -> int:
        return int(self.arch_value("attention.sliding_window", 0))

    @property
    def n_vocab(self) -> int:
        return self.array_lengths.get("tokenizer.ggml.tokens", 0)

    @property
    def file_type(self) -> str:
        """The quantization label (``Q4_K_M``, ``F16``…) the file declares."""
        raw = self.metadata.get("general.file_type")
        if raw is None:
            return "unknown"
        try:
            return FILE_TYPE_IDS.get(int(raw), f"type-{raw}")
        except (TypeError, ValueError):
            return f"type-{raw}"

    @property
    def chat_template(self) -> str | None:
        template = self.metadata.get("tokenizer.chat_template")
        return str(template) if template else None

    @property
    def parameter_count(self) -> int:
        """The model's weights, counted (the file's own count where it gives one)."""
        given = self.metadata.get("general.parameter_count")
        if isinstance(given, int) and given > 0:
            return given
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def end_of_data(self) -> int:
        """Where the last tensor's bytes end: the file must be at least this long."""
        if not self.tensors:
            return self.data_offset
        return self.data_offset + max(t.offset + t.n_bytes for t in self.tensors)


def _first_int(value: Any) -> int:
    """Per-layer arrays (some architectures vary heads by layer) reduce to their maximum."""
    if isinstance(value, list):
        return int(max(value)) if value else 0
    return int(value)


def tensor_bytes(ggml_type: int, n_elements: int) -> int:
    block_size, type_size = GGML_BLOCKS[GGML_TYPE_IDS[ggml_type]]
    return n_elements // block_size * type_size


class _Reader:
    def __init__(self, source: ByteSource, label: str) -> None:
        self._source = source
        self._label = label
        self.position = 0

    def take(self, n: int) -> bytes:
        data = self._source.read(n)
        if len(data) != n:
            raise ModelFileError(
                f"{self._label}: truncated GGUF header (ended at byte {self.position + len(data)})"
            )
        self.position += n
        return data

    def scalar(self, type_id: int) -> Any:
        fmt = _SCALAR_FORMATS[type_id]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return int(self.scalar(4))

    def u64(self) -> int:
        return int(self.scalar(10))

    def string(self) -> str:
        length = self.u64()
        if length > MAX_STRING_BYTES:
            raise ModelFileError(
                f"{self._label}: corrupt GGUF header (a string claims {length} bytes)"
            )
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, type_id: int, key: str, lengths: dict[str, int]) -> Any:
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id)
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type = self.u32()
            count = self.u64()
            if count > MAX_ARRAY_ITEMS:
                raise ModelFileError(
                    f"{self._label}: corrupt GGUF header ({shown(key)} claims {count} items)"
                )
            lengths[key] = count
            if item_type == _ARRAY:
                raise ModelFileError(f"{self._label}: unsupported nested array in {shown(key)}")
            if item_type in _SCALAR_FORMATS and count > KEPT_ARRAY_ITEMS:
                self.take(struct.calcsize(_SCALAR_FORMATS[item_type]) * count)
                return None
            items = [self.value(item_type, key, lengths) for _ in range(count)]
            return items if count <= KEPT_ARRAY_ITEMS else None
        raise ModelFileError(
            f"{self._label}: corrupt GGUF header (unknown value type {type_id} for {shown(key)})"
        )


def parse_header(source: ByteSource, label: str) -> GGUFInfo:
    """Parse the header from ``source``; ``label`` names the file in error messages."""
    reader = _Reader(source, label)
    magic = source.read(4)
    reader.position = len(magic)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{label}: not a GGUF file (it does not start with the GGUF magic)")
    version = reader.u32()
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{label}: unsupported GGUF version {version}")
    tensor_count = reader.u64()
    kv_count = reader.u64()
    if tensor_count > MAX_TENSOR_COUNT or kv_count > MAX_KV_COUNT:
        raise ModelFileError(
            f"{label}: corrupt GGUF header ({tensor_count} tensors, {kv_count} keys)"
        )
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.u32(), key, lengths)
    tensors = []
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.u32()
        if n_dims > MAX_DIMS:
            raise ModelFileError(
                f"{label}: corrupt GGUF header (tensor {shown(name)} has {n_dims} dims)"
            )
        shape = tuple(reader.u64() for _ in range(n_dims))
        type_id = reader.u32()
        offset = reader.u64()
        type_name = GGML_TYPE_IDS.get(type_id)
        if type_name is None:
            raise ModelFileError(f"{label}: tensor {shown(name)} has unknown type {type_id}")
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        tensors.append(
            TensorInfo(name, shape, type_name, offset, tensor_bytes(type_id, n_elements))
        )
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{label}: corrupt GGUF header (alignment {alignment})")
    data_offset = -(-reader.position // alignment) * alignment
    return GGUFInfo(label, version, metadata, tuple(tensors), data_offset, lengths)


# Split GGUF sets: ``name-00001-of-00003.gguf`` … (llama.cpp loads a set from its first part).
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def is_later_split_part(filename: str) -> bool:
    """A split set's second or later part: the set is listed and loaded by its first."""
    match = SPLIT_RE.search(filename)
    return match is not None and match.group(1) != "00001"


def is_projector(filename: str) -> bool:
    """A vision projector (``mmproj-*``): it goes with a chat model, it is not one."""
    return filename.rsplit("/", 1)[-1].lower().startswith("mmproj")


def read_gguf(path: Path) -> GGUFInfo:
    """Inspect a local GGUF file; raises ModelFileError naming the file and the problem."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a file")
    source = FileSource(path)
    try:
        info = parse_header(source, str(path))
    finally:
        source.close()
    size = path.stat().st_size
    if info.end_of_data > size:
        raise ModelFileError(
            f"{path}: truncated GGUF file ({size} bytes, its tensors need {info.end_of_data});"
            " download it again"
        )
    return info


def read_gguf_url(url: str, fetch: RangeFetch) -> GGUFInfo:
    """Inspect a GGUF file on a server (the hub) from its header alone."""
    source = HttpRangeSource(fetch)
    info = parse_header(source, url)
    size = source.size()
    if size is not None and info.end_of_data > size:
        raise ModelFileError(f"{url}: the file is shorter than its header says ({size} bytes)")
    return info


FINGERPRINT_SAMPLES = 16
FINGERPRINT_CHUNK = 64 * 1024


def file_fingerprint(path: Path) -> str:
    """A fast identity for a model file: its size, header and 16 samples of its tensor data.

    Hashing a whole multi-GB file would cost seconds at every load; samples spread over the
    file tell two different models (or a re-quantized one) apart just as well.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(4 * 1024 * 1024))
        for i in range(FINGERPRINT_SAMPLES):
            handle.seek(max(0, size * i // FINGERPRINT_SAMPLES - FINGERPRINT_CHUNK // 2))
            digest.update(handle.read(FINGERPRINT_CHUNK))
        handle.seek(max(0, size - FINGERPRINT_CHUNK))
        digest.update(handle.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()
