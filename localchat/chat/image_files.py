"""An image file's bytes checked before anything stores or decodes them.

A picture the user attaches is read by libmtmd's stb_image when a turn evaluates it, maybe
much later and in another process; a file it cannot read then, or one that decodes to a
gigabyte of pixels, would fail the turn instead of the attach. So an image is refused here,
in one line, unless Pillow reads it whole: the size in bytes first, then the size in pixels
from the header alone (a decompression bomb is never decoded), then every byte decoded.

Formats stb_image reads (PNG, JPEG, GIF, most BMP) are kept as given: the stored bytes are
the user's file. Others Pillow reads (WebP, TIFF, ...) are kept as PNG.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from PIL import Image, ImageFile, UnidentifiedImageError

from localchat.errors import UsageError
from localchat.units import format_bytes

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000
READABLE = "PNG, JPEG, GIF, BMP or WebP"
# Pillow's format → the MIME type of the bytes kept as given (what stb_image reads).
_KEPT = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "BMP": "image/bmp"}
_MAGIC = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"GIF87a",
    b"GIF89a",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
)
# What a file Pillow cannot read looks like, by its first bytes: (magic, offset, what).
_LOOKS_LIKE = (
    (b"%PDF-", 0, "a PDF"),
    (b"ftypheic", 4, "a HEIC photo"),
    (b"ftypheix", 4, "a HEIC photo"),
    (b"ftypavif", 4, "an AVIF image"),
    (b"<svg", 0, "an SVG drawing"),
    (b"<?xml", 0, "an XML file (an SVG drawing?)"),
)
# What a damaged file raises while Pillow decodes it.
_DAMAGE = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


class ImageRejected(UsageError):
    """An image file that will not be stored: what is wrong with it and what to do."""


@dataclass(frozen=True)
class ImageFacts:
    """A checked image: the bytes to store (the file's, or PNG) and what they hold."""

    mime: str
    width: int
    height: int
    size_bytes: int
    data: bytes


def looks_like_image(data: bytes) -> bool:
    """Whether ``data`` opens like an image file (by its magic bytes; nothing is decoded):
    what routes an attached file to the image path instead of the text one."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return True
    return data.startswith(_MAGIC)


def is_image_path(path: Path) -> bool:
    """Whether the file at ``path`` opens like an image (False where it cannot be read)."""
    try:
        with path.open("rb") as handle:
            return looks_like_image(handle.read(16))
    except OSError:
        return False


def read_image_file(path: Path) -> ImageFacts:
    """The image at ``path``, checked (``inspect_image``); a file too large is refused
    before it is read."""
    try:
        if path.is_dir():
            raise ImageRejected(f"{path} is a folder; give an image file from it")
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ImageRejected(_too_large(str(path), size))
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImageRejected(f"{path}: no such file; check the path") from None
    except PermissionError:
        raise ImageRejected(f"{path}: not readable (permission denied)") from None
    return inspect_image(data, str(path))


def inspect_image(data: bytes, name: str) -> ImageFacts:
    """``data`` as an image to store, or ``ImageRejected`` naming ``name``: empty, too many
    bytes, not an image, too many pixels (from the header, before decoding), or damaged."""
    if not data:
        raise ImageRejected(f"{name} is empty; there is no image in it")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRejected(_too_large(name, len(data)))
    image = _open(data, name)
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageRejected(f"{name} is an image of no pixels ({width}x{height}); give another")
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageRejected(_too_many_pixels(name, width, height))
    _decode_whole(data, name)
    kept = _KEPT.get(image.format or "")
    if kept is not None and _stb_reads(image):
        return ImageFacts(kept, width, height, len(data), data)
    png = _as_png(data, name)
    return ImageFacts("image/png", width, height, len(png), png)


def _open(data: bytes, name: str) -> ImageFile.ImageFile:
    """The image's header read (no pixels decoded). Pillow's own bomb guard stays as it
    is: its warning is silenced and its error reported here, where our lower limit holds."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageRejected(
            f"{name} has more pixels than the {MAX_IMAGE_PIXELS // 1_000_000} megapixels"
            " an image may have; scale it down and attach it again"
        ) from None
    except UnidentifiedImageError:
        raise ImageRejected(_not_an_image(data, name)) from None
    except _DAMAGE as exc:
        raise ImageRejected(_damaged(name, exc)) from None
    if not isinstance(image, ImageFile.ImageFile):  # pragma: no cover - Pillow opens files
        raise ImageRejected(_not_an_image(data, name))
    return image


def _decode_whole(data: bytes, name: str) -> None:
    """Decode every pixel (of the first frame) once, refusing a file that is cut short or
    damaged; its chunks' checksums are verified first where the format has them."""
    truncated_ok = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # a short file raises instead of going grey
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            Image.open(BytesIO(data)).verify()
            Image.open(BytesIO(data)).load()
    except _DAMAGE as exc:
        raise ImageRejected(_damaged(name, exc)) from None
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = truncated_ok


def _stb_reads(image: ImageFile.ImageFile) -> bool:
    """Whether stb_image reads these bytes as they are: not a 1-bit or run-length BMP."""
    if image.format != "BMP":
        return True
    return image.mode != "1" and image.info.get("compression", 0) in (0, 3)


def _as_png(data: bytes, name: str) -> bytes:
    """The first frame as PNG, in a mode stb_image reads (8 bits a channel)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image: Image.Image = Image.open(BytesIO(data))
            image.seek(0)
            if image.mode not in ("RGB", "RGBA", "L", "LA"):
                alpha = "A" in image.getbands() or "transparency" in image.info
                image = image.convert("RGBA" if alpha else "RGB")
            out = BytesIO()
            image.save(out, format="PNG")
    except _DAMAGE as exc:
        raise ImageRejected(_damaged(name, exc)) from None
    return out.getvalue()


def _not_an_image(data: bytes, name: str) -> str:
    for magic, offset, what in _LOOKS_LIKE:
        if data[offset : offset + len(magic)] == magic:
            return f"{name} is {what}, not an image localchat reads; convert it to PNG or JPEG"
    if looks_like_image(data):
        return (
            f"{name} opens like an image but cannot be read (damaged, or a kind of it"
            " localchat does not read); save it again as PNG or JPEG"
        )
    return f"{name} is not an image ({READABLE}); give an image file"


def _too_large(name: str, size: int) -> str:
    return (
        f"{name} is {format_bytes(size)}: larger than the {format_bytes(MAX_IMAGE_BYTES)} an"
        " image may be; save it smaller (JPEG, or scaled down) and attach it again"
    )


def _too_many_pixels(name: str, width: int, height: int) -> str:
    return (
        f"{name} is {width}x{height} pixels: more than the"
        f" {MAX_IMAGE_PIXELS // 1_000_000} megapixels an image may have; scale it down and"
        " attach it again"
    )


def _damaged(name: str, exc: BaseException) -> str:
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return f"{name} is damaged or cut short ({detail}); save it again and attach the new file"
