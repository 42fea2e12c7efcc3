"""Reasoning replies: ``<think>…</think>`` is the model thinking aloud, apart from the answer.

The transcript keeps a reply as the model wrote it (the template decides what later turns
see of it: Qwen3 and DeepSeek-R1 strip earlier reasoning themselves); what is shown, printed
and exported separates the two. A template may open the block in the generation prompt
itself, so a reply can start inside it.
"""

from __future__ import annotations

from localchat.chat.stops import StopFilter

OPEN = "<think>"
CLOSE = "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the prompt leaves the model inside a reasoning block (the template opened it)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply; ``opened``: the prompt opened the block."""
    body = text
    if text.lstrip().startswith(OPEN):
        body, opened = text.lstrip()[len(OPEN) :], True
    elif CLOSE in text and OPEN not in text:
        body, opened = text, True  # a stored reply whose prompt opened the block
    if not opened:
        return "", text
    reasoning, closed, answer = body.partition(CLOSE)
    if not closed:
        return reasoning.strip("\n"), ""
    return reasoning.strip("\n"), answer.lstrip("\n")


class ReasoningStream:
    """Feed streamed pieces; get (is_reasoning, text) parts, tags removed, never split."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "start"
        self._start = ""  # text seen before deciding whether the reply opens a block
        self._close = StopFilter((CLOSE,))
        self._after_close = False

    def feed(self, piece: str) -> list[tuple[bool, str]]:
        parts: list[tuple[bool, str]] = []
        if self.state == "start":
            self._start += piece
            body = self._start.lstrip()
            if body.startswith(OPEN):
                self.state, piece = "reasoning", body[len(OPEN) :].lstrip("\n")
            elif OPEN.startswith(body):
                return parts  # maybe the opening tag: wait for more
            else:
                self.state, piece = "answer", self._start
        if self.state == "reasoning":
            text, closed = self._close.feed(piece)
            if text:
                parts.append((True, text))
            if not closed:
                return parts
            self.state, piece, self._after_close = "answer", self._close.after, True
        if self._after_close:  # the blank line after the block belongs to neither
            piece = piece.lstrip("\n")
            self._after_close = not piece
        if piece:
            parts.append((False, piece))
        return parts

    def flush(self) -> list[tuple[bool, str]]:
        """What was held back, once the reply ended."""
        if self.state == "start":
            self.state = "answer"
            return [(False, self._start)] if self._start else []
        held = self._close.flush()
        return [(self.state == "reasoning", held)] if held else []
