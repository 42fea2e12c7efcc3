"""Stop strings for streamed text: a reply ends where a stop string begins.

Text that could be the start of a stop string is held back until the next piece shows
whether it is one, so a stop string is never shown, not even in part.
"""

from __future__ import annotations


class StopFilter:
    """Feed streamed pieces; get back what may be shown, and whether a stop was reached."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.after = ""  # once stopped: the text that followed the stop string
        self.matched: str | None = None  # once stopped: the stop string that ended it

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.pending + piece
        hits = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)
            self.pending = ""
            self.after = text[at + len(stop) :]
            self.matched = stop
            return text[:at], True
        hold = max((_overlap(text, stop) for stop in self.stops), default=0)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """What was held back, once the reply ended for another reason."""
        text, self.pending = self.pending, ""
        return text


def _overlap(text: str, stop: str) -> int:
    """The longest end of ``text`` that is a proper start of ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
