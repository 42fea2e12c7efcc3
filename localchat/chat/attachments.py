"""Text files put into a message: each under its name, fenced, before what the user wrote.

The model reads ``File: NAME`` and the file's text in a code fence longer than any run of
backticks inside it, so the file can hold code blocks of its own; the user's words follow
after a blank line. The same files attached first, in the same order, give the same leading
tokens: a new conversation that starts with them restores their evaluated state (a shared
prefix state) instead of reading them again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from localchat.chat.window import WindowPolicy
from localchat.errors import UsageError
from localchat.units import format_bytes

MAX_ATTACHMENT_BYTES = 8 * 1024 * 1024
_SNIFF_BYTES = 8192
_LANGUAGES = {
    ".py": "python",
    ".md": "markdown",
    ".js": "javascript",
    ".ts": "typescript",
    ".rs": "rust",
    ".go": "go",
    ".c": "c",
    ".h": "c",
    ".cpp": "cpp",
    ".java": "java",
    ".sh": "bash",
    ".json": "json",
    ".toml": "toml",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".html": "html",
    ".css": "css",
    ".sql": "sql",
}
# One attached file as it opens a message (see ``with_attachments``).
_BLOCK = re.compile(r"File: [^\n]*\n(`{3,})[^\n]*\n.*?\n\1\n(?:\n|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Attachment:
    name: str
    text: str

    def block(self) -> str:
        """The file as the model reads it: its name, then its text fenced."""
        longest = max((len(run) for run in re.findall(r"`+", self.text)), default=0)
        fence = "`" * max(3, longest + 1)
        language = _LANGUAGES.get(Path(self.name).suffix.lower(), "")
        return f"File: {self.name}\n{fence}{language}\n{self.text.rstrip(chr(10))}\n{fence}\n"


def read_attachment(path: Path) -> Attachment:
    """A text file (code, Markdown, logs) to attach; anything else is refused in one line."""
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise UsageError(f"{path} is a folder; attach a file from it")
        if size > MAX_ATTACHMENT_BYTES:
            raise UsageError(
                f"{path} is {format_bytes(size)}: larger than the"
                f" {format_bytes(MAX_ATTACHMENT_BYTES)} an attachment may be; attach a part of it"
            )
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; check the path") from None
    except PermissionError:
        raise UsageError(f"{path}: not readable (permission denied)") from None
    if data[:5] == b"%PDF-":
        raise UsageError(
            f"{path} is a PDF; attach its text instead (for example: pdftotext {path.name})"
        )
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise UsageError(f"{path} is not a text file; attach code, Markdown or logs")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{path} is not UTF-8 text (byte {exc.start} cannot be read); convert it to UTF-8"
        ) from None
    if not text.strip():
        raise UsageError(f"{path} is empty; there is nothing in it to attach")
    return Attachment(path.name, text.replace("\r\n", "\n"))


def with_attachments(text: str, attachments: Sequence[Attachment]) -> str:
    """The message the model reads: each file's block, then what the user wrote (from its
    first non-blank character: the files' tokens then end the same way whatever follows)."""
    blocks = [a.block() for a in attachments]
    return "\n".join([*blocks, text.lstrip()]) if blocks else text


# Room beyond the message and the reply: the template's own tokens around them.
TEMPLATE_ROOM_TOKENS = 32


def check_fits(
    attachments: Sequence[Attachment],
    message_tokens: int,
    head_tokens: int,
    n_ctx: int | None,
    max_tokens: int,
) -> None:
    """Refuse, in one line, a message with files that the context cannot hold with the
    system prompt (``head_tokens``) and the room the window keeps for a reply of up to
    ``max_tokens`` (a context not known: no check)."""
    reserve = WindowPolicy().reserve(n_ctx, max_tokens) if n_ctx else max_tokens
    need = head_tokens + message_tokens + reserve + TEMPLATE_ROOM_TOKENS
    if not attachments or n_ctx is None or need <= n_ctx:
        return
    names = ", ".join(a.name for a in attachments)
    raise UsageError(
        f"{names} with your message come to {message_tokens:,} tokens, and the context holds"
        f" {n_ctx:,} with {reserve:,} kept for the reply; use --ctx {need} or more, or attach"
        " less (a part of the file)"
    )


def attachments_end(message: str) -> int:
    """Where the attached files a message opens with end (0: it opens with none)."""
    end = 0
    while match := _BLOCK.match(message, end):
        end = match.end()
    return end
