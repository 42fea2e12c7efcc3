"""The message box: Enter sends, Shift+Enter or Ctrl+J starts a new line; a pasted path to
an image file (a file dragged onto the terminal) attaches the image."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from textual import events
from textual.message import Message
from textual.widgets import TextArea

# A paste longer than this is text, never a path (no file is looked up for it).
MAX_PATH_CHARS = 4096


def pasted_path(text: str) -> Path | None:
    """The file a paste names, where the paste is exactly one path to an existing file: as
    typed, quoted (as terminals paste a dragged file), backslash-escaped, or a file: URL."""
    text = text.strip()
    if not text or len(text) > MAX_PATH_CHARS or "\n" in text:
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    elif text.startswith("file://"):
        text = unquote(urlparse(text).path)
    elif "\\" in text and os.name != "nt":
        text = re.sub(r"\\(.)", r"\1", text)
    try:
        path = Path(text).expanduser()
        return path if path.is_file() else None
    except (OSError, ValueError, RuntimeError):
        return None


def pasted_image(text: str) -> Path | None:
    """The image file a paste is the path of, if it is exactly that."""
    path = pasted_path(text)
    if path is None:
        return None
    from localchat.chat.image_files import is_image_path

    return path if is_image_path(path) else None


class PromptInput(TextArea):
    """A multi-line input that posts ``Submitted`` on Enter, and ``ImagePasted`` for a paste
    that is the path of an image file (the path is not put in the box)."""

    @dataclass
    class Submitted(Message):
        text: str

    @dataclass
    class ImagePasted(Message):
        path: Path

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.prevent_default()
            event.stop()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.prevent_default()
            event.stop()
            self.insert("\n")
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        path = None if self.read_only else pasted_image(event.text)
        if path is not None:  # TextArea's own handler (it inserts the text) is not called
            event.prevent_default()
            event.stop()
            self.post_message(self.ImagePasted(path))
