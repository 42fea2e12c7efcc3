"""An image a message shows, as the transcript draws it: a line that names it (its file's
name where known, else its key's start), its size and its pixels; and under it the picture,
where the terminal can draw one (textual-image picks kitty's protocol, sixels or half
cells by what the terminal answers).

The terminal is asked what it draws before Textual starts (``enable_pictures``, from
``run_app``): once Textual reads the terminal's input it cannot be asked. An app run any
other way (``App.run_test()``, the bench) draws the line alone. Pictures are scaled down
off the app's thread (``picture_of``, in the workers that read the images)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from localchat.text import printable
from localchat.units import format_bytes

if TYPE_CHECKING:  # Pillow is imported where an image is read, in a worker
    from localchat.chat.image_files import ImageFacts
    from localchat.state.images import ImageStore, StoredImage

# The largest picture kept for drawing, in pixels a side (a terminal shows far fewer).
PICTURE_SIDE = 768
# textual-image's widget where the terminal draws pictures; None: the line alone.
_picture_widget: type[Widget] | None = None


def enable_pictures() -> bool:
    """Ask the terminal what it draws (before Textual starts): pictures are drawn from now
    on where it draws more than characters. Whether they are."""
    global _picture_widget
    try:
        from textual_image import renderable
        from textual_image.widget import Image
    except Exception:  # not installed, or the terminal did not answer sanely
        return False
    if renderable.Image is not renderable.UnicodeImage:
        _picture_widget = Image
    return _picture_widget is not None


def pictures_enabled() -> bool:
    return _picture_widget is not None


@dataclass(frozen=True)
class ImageLine:
    """An image as the transcript shows it; ``key`` once it is stored, ``picture`` (a
    scaled-down Pillow image) where the terminal draws pictures."""

    name: str
    size_bytes: int = 0
    width: int = 0
    height: int = 0
    key: str | None = None
    missing: bool = False  # the store no longer holds it
    picture: Any = None

    def describe(self) -> str:
        if self.missing:
            return f"▣ {self.name} · not in the image store (deleted?)"
        return f"▣ {self.name} · {format_bytes(self.size_bytes)} · {self.width}×{self.height} px"


@dataclass(frozen=True)
class AttachedImage:
    """An image that goes with the next message: checked bytes to store when it is sent,
    or the key of one stored already (a message asked again); and its line."""

    line: ImageLine
    source: ImageFacts | str


def picture_of(source: bytes | Path) -> Any:
    """The picture to draw, scaled down, or None where none is drawn (off the app's
    thread: it decodes the image)."""
    if _picture_widget is None:
        return None
    from io import BytesIO

    from PIL import Image

    with contextlib.suppress(Exception):  # a picture not drawn leaves its line
        image = Image.open(BytesIO(source) if isinstance(source, bytes) else source)
        image.thumbnail((PICTURE_SIDE, PICTURE_SIDE))
        return image.convert("RGBA" if "A" in image.getbands() else "RGB")
    return None


def attached_image(path: Path, facts: ImageFacts) -> AttachedImage:
    """A file read for the next message (in the worker that read it)."""
    line = ImageLine(printable(path.name), facts.size_bytes, facts.width, facts.height)
    return AttachedImage(_with_picture(line, facts.data), facts)


def stored_lines(store: ImageStore, keys: Iterable[str]) -> tuple[ImageLine, ...]:
    """The lines of stored images (off the app's thread: each one's note is read)."""
    return tuple(stored_line(store.find(key), key) for key in keys)


def stored_line(stored: StoredImage | None, key: str, name: str | None = None) -> ImageLine:
    if stored is None:
        return ImageLine(name or key[:12], key=key, missing=True)
    line = ImageLine(name or key[:12], stored.size_bytes, stored.width, stored.height, key)
    return _with_picture(line, stored.path)


def _with_picture(line: ImageLine, source: bytes | Path) -> ImageLine:
    picture = picture_of(source)
    if picture is None:
        return line
    return ImageLine(
        line.name, line.size_bytes, line.width, line.height, line.key, line.missing, picture
    )


class ImageView(Vertical):
    """One image of a message: its line, and the picture where the terminal draws one."""

    def __init__(self, line: ImageLine) -> None:
        super().__init__(classes="image")
        self.line = line

    def compose(self) -> ComposeResult:
        # A Text object: a file's name is never parsed as markup.
        yield Static(Text(self.line.describe()), classes="image-line")
        if self.line.picture is not None and _picture_widget is not None:
            yield _picture_widget(self.line.picture, classes="picture")
