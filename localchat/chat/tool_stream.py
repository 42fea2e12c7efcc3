"""A reply that may call tools, streamed: its text as it comes, its calls held back and
read at its end, in the model's own format (``chat.tools``) — the server's SSE, the CLI and
the app show the same split."""

from __future__ import annotations

from dataclasses import dataclass

from localchat.chat.tools import ToolCall, call_start, parse_tool_calls

LLAMA3_TAG = "<|python_tag|>"
GENERIC_STARTS = ("{", "```")


@dataclass
class ToolCallStream:
    """A streamed reply that may call tools: text before the family's call marker goes on
    at once (a marker's possible start held back), the rest waits for the end, where its
    calls are parsed. Llama 3's call is a whole reply that starts with ``{``: a reply that
    starts otherwise streams as text. The generic format's (JSON, bare or fenced) is held
    from the first ``{`` or fence on."""

    family: str
    known: set[str]
    _held: str = ""
    _mode: str = ""  # "" (deciding), "call" (held to the end) or "text" (no call can come)

    def feed(self, piece: str) -> str:
        """What of ``piece`` can be shown now."""
        if self._mode == "text":
            return piece
        self._held += piece
        if self._mode == "call":
            return ""
        if self.family == "llama3":
            return self._feed_llama3()
        marker = call_start(self.family)
        # The generic format's call is JSON, bare or fenced: prose streams up to the first
        # place one could begin, and the rest waits for the reply's end.
        starts = (marker,) if marker is not None else GENERIC_STARTS
        found = [at for start in starts if (at := self._held.find(start)) != -1]
        if found:
            at = min(found)
            shown, self._held = self._held[:at], self._held[at:]
            self._mode = "call"
            return shown
        keep = max(_partial_suffix(self._held, start) for start in starts)
        cut = len(self._held) - keep
        shown, self._held = self._held[:cut], self._held[cut:]
        return shown

    def _feed_llama3(self) -> str:
        start = self._held.lstrip()
        if not start or LLAMA3_TAG.startswith(start):
            return ""  # it may still become a call
        if start.startswith(("{", LLAMA3_TAG)):
            self._mode = "call"
            return ""
        self._mode = "text"
        shown, self._held = self._held, ""
        return shown

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text still to show and the calls the reply made."""
        content, calls = parse_tool_calls(self._held, self.family, self.known)
        if not calls:
            return self._held, []
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
