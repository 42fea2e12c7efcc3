"""What a tool call gives back, as the model and the user get it: text only, cut to a size
the context can take (saying so), never markup or terminal escapes."""

from __future__ import annotations

from dataclasses import dataclass

from localchat.text import printable

DEFAULT_RESULT_CHARS = 8000


@dataclass(frozen=True)
class ToolResult:
    """A call's result: its text, whether the tool (or the call) failed, and how much was
    cut off to fit."""

    text: str
    is_error: bool = False
    cut_chars: int = 0


def limited(text: str, is_error: bool, max_chars: int) -> ToolResult:
    """``text`` as a result: control characters made visible, cut to ``max_chars`` with a
    line that says how much the model does not see."""
    text = printable(text)
    if len(text) <= max_chars:
        return ToolResult(text, is_error)
    cut = len(text) - max_chars
    note = f"\n[localchat: the result was cut to {max_chars:,} of {len(text):,} characters]"
    return ToolResult(text[:max_chars] + note, is_error, cut)


def failure(message: str) -> ToolResult:
    """A call that could not run (a server down, a timeout, a refusal): what the model is told."""
    return ToolResult(f"error: {message}", True)
