"""Models that are only timed or measured: random blocks in the tensor types of a real file.

How fast llama.cpp reads a matrix, and how much memory it takes, depend on its type and shape,
never on its values, so these files are written in a blink where a quantizer takes minutes:
- the speed calibration's files, one weight type throughout (``SpeedScratch``);
- a demo shape at the exact type mix llama.cpp's quantizer gives a quant (``ensure_mix_model``:
  Q4_K_M is Q4_K with Q6_K in half the value and down projections, say, and falls back to
  Q5_0 where rows do not divide into k-quant blocks). The mix is read off a narrow twin of
  the shape — the same layers, heads and tensor names, rows that divide into the same blocks —
  quantized by llama.cpp in a second, so it is what llama.cpp chooses, not a copy of its rules.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import tempfile
from dataclasses import replace
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from localchat.cpu import last_level_cache_bytes
from localchat.errors import UsageError
from localchat.gguf.info import GGUFInfo, read_gguf
from localchat.models.demo import (
    QUANTS,
    SHAPES,
    SPEED_TYPES,
    ModelShape,
    quantize_into,
    write_over,
    write_staged,
)

# The speed calibration's shape (not offered as a demo): Qwen2.5-1.5B's row lengths (a row's
# fixed cost makes a byte's cost depend on them, models/speed.py; 1.5B is the middle of what
# laptops run), its layers set per weight type by calibration_shape().
CALIBRATION_SHAPE = ModelShape("calib", 1, 1536, 12, 2, 8960, 8192, 8192, 10000.0)
# What each calibration file reads per token, at least (the floor: see CACHE_SHARE). Smaller
# files run partly from a large processor cache and time fast by luck: measured on a 2-core
# Xeon with a 480 MiB L3, a 43 MB Q2_K file read 175-250 tok/s where 88 MB and larger ones
# all cost the same per byte (the 0.5b and 1b demo models' Q2_K then predicted 1.4-1.6x
# too fast).
CALIBRATION_MIN_BYTES = 100_000_000
# ... and at least this share of the last-level cache's reported size. How much of a shared
# cache a virtual machine gets moves with its neighbours: on that Xeon another day, files of
# 110-130 MB read 1.1-1.65x faster per byte than files of 500-940 MB of their type (Q4_K
# 1.12, F16 1.15, Q6_K 1.28, Q8_0 1.36, Q2_K 1.57, Q4_0 1.65), a Q5_0 file of 290 MB cost
# what one of 570 MB did, and every quantized 0.5b and 1b demo model (235-1,170 MB) predicted
# 1.4-2x too fast (bench speed_prediction_max_error 0.42 and 1.005). Past 40% of the cache
# (192 MB there, half as much again as the files that read fast) a file reads as a model of
# a few hundred MB does; on a machine of a 32 MB cache it changes nothing. (Each file's
# bytes cost reading time in the first calibration, 20 s at most: 12.8 s there at 40%.)
CACHE_SHARE = 0.4
# ... but never more than this: a reported cache of gigabytes (a hypervisor's whole host, a
# future part) would make each of the nine files read that large.
CALIBRATION_MAX_BYTES = 512_000_000


def calibration_min_bytes() -> int:
    """What a calibration file reads per token here, at least (``CACHE_SHARE``, within
    ``CALIBRATION_MIN_BYTES`` and ``CALIBRATION_MAX_BYTES``)."""
    share = int(CACHE_SHARE * last_level_cache_bytes())
    return max(CALIBRATION_MIN_BYTES, min(CALIBRATION_MAX_BYTES, share))


def calibration_shape(weight_type: str) -> ModelShape:
    """The calibration shape with enough layers that a ``weight_type`` file reads at least
    ``calibration_min_bytes`` per token (more layers cost reading time, so no more), and at
    least two: a prompt skips the last layer's feed-forward (speed.token_work), so one layer
    would leave a prompt reading too little work to price."""
    shape = CALIBRATION_SHAPE
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]]
    hd = shape.head_dim
    layer_weights = shape.n_embd * (2 * shape.n_head * hd + 2 * shape.n_head_kv * hd)
    layer_weights += 3 * shape.n_embd * shape.n_ff
    output = shape.n_vocab * shape.n_embd * block_bytes // block_weights
    layer = layer_weights * block_bytes // block_weights
    layers = max(2, -(-(calibration_min_bytes() - output) // layer))
    return replace(shape, n_layer=layers)


SCRATCH_PREFIX = ".speed-calibration-"  # and a random name: two calibrations never share one


class SpeedScratch:
    """The calibration's one file on disk: each weight type's speed model (every matrix of
    that type, its blocks random: written in a blink, no quantizer) is written into it in
    turn, over the last one's bytes (``demo.write_over``), just before it is read. Locked
    while in use (``remove_left_speed_models`` leaves it alone) and deleted when closed:
    nine files kept would hold 1-2 GB of the user's disk, and on a virtual machine making
    nine fresh files took longer than reading them twice."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{SCRATCH_PREFIX}{secrets.token_hex(6)}.gguf"
        self.holds: str | None = None
        self._infos: dict[str, GGUFInfo] = {}
        self._lock: int | None = None

    def holding(self, weight_type: str) -> Path:
        """The file, holding ``weight_type``'s speed model (written now unless it does)."""
        if weight_type not in SPEED_TYPES:
            raise UsageError(f"no speed model of {weight_type!r}; one of {', '.join(SPEED_TYPES)}")
        if self.holds != weight_type:
            self.holds = None  # a write that fails leaves no type named
            if self._lock is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._lock = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._lock, fcntl.LOCK_EX)
            file_type = LlamaFileType.MOSTLY_F16 if weight_type == "F16" else None
            write_over(self.path, calibration_shape(weight_type), weight_type, file_type)
            self.holds = weight_type
            self._infos.setdefault(weight_type, read_gguf(self.path))
        return self.path

    def info(self, weight_type: str) -> GGUFInfo:
        """``weight_type``'s speed model's header (written first if it never was)."""
        if weight_type not in self._infos:
            self.holding(weight_type)
        return self._infos[weight_type]

    def close(self) -> None:
        self.holds = None
        self.path.unlink(missing_ok=True)
        if self._lock is not None:
            os.close(self._lock)  # the lock goes with it
            self._lock = None

    def __enter__(self) -> SpeedScratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_left_speed_models(directory: Path) -> None:
    """Delete the speed models left in ``directory``: those earlier versions kept (100 MB or
    more each, nine of them) and the scratch files of calibrations that were killed (no
    process holds their lock; a lock, unlike a process id, is seen across containers)."""
    for path in directory.glob("speed-*.gguf"):
        with contextlib.suppress(OSError):  # one it cannot delete is left; it is never read
            path.unlink(missing_ok=True)
    for path in directory.glob(f"{SCRATCH_PREFIX}*.gguf"):
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except OSError:
            continue  # a calibration running now holds it (or it cannot be deleted)
        finally:
            os.close(descriptor)


# A k-quant block's weights, and the legacy quants' (Q8_0, Q5_0, Q4_0): a row that does not
# divide into the first falls back to the second kind (llama.cpp's quantizer decides which).
K_BLOCK = 256
LEGACY_BLOCK = 32


def _twin_length(length: int, multiple: int) -> int:
    """The shortest row length, a multiple of ``multiple`` and of the legacy block, that
    divides into k-quant blocks exactly when ``length`` does."""
    if length % LEGACY_BLOCK:
        raise UsageError(f"rows of {length} weights do not divide into blocks of {LEGACY_BLOCK}")
    step = math.lcm(multiple, LEGACY_BLOCK)
    twin = step
    while (twin % K_BLOCK == 0) != (length % K_BLOCK == 0):
        twin += step
    return twin


def narrow_twin(shape: ModelShape) -> ModelShape:
    """``shape`` with its rows as short as they can be while the quantizer treats every tensor
    as it treats the full one: the same layers, heads and names; rows of the same blocks."""
    n_ff = _twin_length(shape.n_ff, 1)
    if shape.head_dim_set:  # the attention width is its own row length (Gemma 3)
        width = _twin_length(shape.n_head * shape.head_dim, 2 * shape.n_head)
        n_embd = _twin_length(shape.n_embd, 1)
        return replace(shape, n_embd=n_embd, n_ff=n_ff, head_dim_set=width // shape.n_head)
    return replace(shape, n_embd=_twin_length(shape.n_embd, 2 * shape.n_head), n_ff=n_ff)


def quant_mix(shape: ModelShape, quant: str) -> dict[str, str]:
    """Each tensor's type, by name, in a ``quant`` file of ``shape`` as llama.cpp's quantizer
    makes it (read off its narrow twin, quantized for real)."""
    if quant not in QUANTS:
        raise UsageError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    if quant == "F16":
        return {}
    with tempfile.TemporaryDirectory(prefix="localchat-mix-") as tmp:
        f16, quantized = Path(tmp) / "twin-F16.gguf", Path(tmp) / f"twin-{quant}.gguf"
        write_staged(f16, narrow_twin(shape), seed=0)
        quantize_into(f16, quantized, quant)
        # Our header reader: gguf's GGUFReader parses the 32k-token vocabulary (2.5 s).
        mix = {t.name: t.ggml_type for t in read_gguf(quantized).tensors}
    unwritable = sorted({t for t in mix.values() if t not in (*SPEED_TYPES, "F32")})
    if unwritable:
        raise UsageError(f"{quant} holds {', '.join(unwritable)}: no random blocks of it here")
    return mix


def mix_model_path(directory: Path, shape: str, quant: str, seed: int = 0) -> Path:
    """Where the random-block model of a demo shape at a quant's mix is kept (the name
    changes with the shape's rows, so a file of an older shape is never read as this one)."""
    dims = SHAPES[shape]
    return directory / f"mix-{shape}-{dims.n_embd}x{dims.n_ff}-{quant}-s{seed}.gguf"


def ensure_mix_model(directory: Path, shape: str, quant: str, seed: int = 0) -> Path:
    """A demo shape with each tensor of the type a ``quant`` file has, its blocks random
    (made on first use): the same bytes by type, so the same speed and memory as the real
    quantized model, written in seconds where quantizing takes half a minute."""
    if shape not in SHAPES:
        raise UsageError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    path = mix_model_path(directory, shape, quant, seed)
    if not path.exists():
        mix = quant_mix(SHAPES[shape], quant)
        file_type = LlamaFileType[f"MOSTLY_{quant}"]
        directory.mkdir(parents=True, exist_ok=True)
        write_staged(path, SHAPES[shape], seed, weight_types=mix or "F16", file_type=file_type)
    return path
