"""The reply being streamed: its text handed to a Markdown stream at a pace the machine can
afford (see ``localchat.tui.pacing``), its thinking shown as it comes."""

from __future__ import annotations

from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from localchat.tui.pacing import FramePacer
from localchat.tui.widgets.chat_message import AssistantMessage


class ReplyView(AssistantMessage):
    """A reply while it is written, then as it stays in the transcript. It owns the stream
    its text is drawn through, the pacer that decides when a frame is drawn, and the text
    the pacer held back."""

    def __init__(self) -> None:
        super().__init__()
        self._stream: MarkdownStream | None = None
        self._pacer: FramePacer | None = None
        self._undrawn = ""  # reply text received but not drawn yet (the pacer held it)

    def open_stream(self) -> None:
        """Once mounted: the Markdown stream the text goes through."""
        self._stream = Markdown.get_stream(self.markdown)
        self._undrawn = ""

    def pace(self, generation_threads: int) -> None:
        """Generation starts: the app's drawing budget is a share of what it costs."""
        self._pacer = FramePacer(generation_threads)

    async def take(self, text: str, reasoning: str) -> bool:
        """Text generated since the last chunk; drawn now where the pacer allows a frame
        (True), else kept for a later one."""
        if reasoning:
            self.append_reasoning(reasoning)
        self._undrawn += self.append(text)
        if self._pacer is not None and self._pacer.frame_due():
            await self.draw()
            return True
        return False

    async def draw(self) -> None:
        """Hand the text the pacer held back to the Markdown stream (one frame)."""
        if self._stream is not None and self._undrawn:
            await self._stream.write(self._undrawn)
        self._undrawn = ""

    async def close_stream(self) -> None:
        """The reply is over (or never came): the stream stops; text not drawn is dropped
        (``draw`` first to keep it)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._pacer = None
        self._undrawn = ""

    async def finish(self) -> None:
        """The reply ended: everything drawn, the stream closed, the thinking folded where
        there is an answer to read."""
        await self.draw()
        await self.close_stream()
        if self.raw.strip():
            self.collapse_reasoning()
