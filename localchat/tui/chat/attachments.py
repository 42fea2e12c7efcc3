"""Files that go with the next message: chosen, read and counted in a worker (the model's
tokenizer, or the server's), refused when the context cannot hold them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual import work

from localchat.chat.attachments import check_fits, read_attachment
from localchat.errors import LocalchatError
from localchat.tui.chat.base import ChatScreenBase
from localchat.tui.messages import AttachmentReady
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel

if TYPE_CHECKING:
    from localchat.session import Session


class AttachmentActions(ChatScreenBase):
    """Ctrl+T: attach a text file to the next message (Esc removes it again)."""

    def action_attach(self) -> None:
        if self.backend is None:
            self.notify("No model is loaded yet.", severity="warning")
            return

        def chosen(path: str | None) -> None:
            session = self.session
            if path and session is not None:
                conversation = self.conversation
                system = conversation.record.system_prompt if conversation else None
                self.load_attachment(session, Path(path).expanduser(), system)

        hint = "its path · Ctrl+S attaches · Esc cancels"
        self.app.push_screen(TextPromptScreen("Attach a text file", "", hint), chosen)

    @work(thread=True, exit_on_error=False, group="attach")
    def load_attachment(self, session: Session, path: Path, system: str | None) -> None:
        """Read the file and count its tokens (the model's tokenizer, or the server's) and
        the system prompt's (``system``: what the conversation had when it was chosen)."""
        try:
            attachment = read_attachment(path)
            tokens = session.count_tokens(attachment.block())
            head = session.count_tokens(system) if system else 0
        except LocalchatError as exc:
            self.app.call_from_thread(
                self.notify, str(exc), title="Not attached", severity="error", timeout=15
            )
            return
        self.post_message(AttachmentReady(attachment, tokens, head))

    def on_attachment_ready(self, message: AttachmentReady) -> None:
        backend = self.backend
        if backend is None or self.torn_down():
            return
        pending = [*self.attachments, message.attachment]
        tokens = [*self._attachment_tokens, message.tokens]
        n_ctx = backend.context_size
        try:
            check_fits(pending, sum(tokens), message.head_tokens, n_ctx, self.max_tokens)
        except LocalchatError as exc:
            self.notify(str(exc), title="Not attached", severity="error", timeout=15)
            return
        self.attachments, self._attachment_tokens = pending, tokens
        names = ", ".join(a.name for a in pending)
        self.query_one(StatsPanel).show_turn_start(
            f"attached {names}: goes with your next message (Esc removes)"
        )
        self.notify(f"Attached {message.attachment.name}: {message.tokens:,} tokens.")
        self.query_one(PromptInput).focus()
        self.read_ahead_box()  # the file is read while the question is typed

    def remove_attachments(self) -> None:
        """Esc with files attached: they go, the words in the box stay."""
        names = ", ".join(a.name for a in self.attachments)
        self.attachments, self._attachment_tokens = [], []
        self.query_one(StatsPanel).show_turn_start("no files attached")
        self.notify(f"Removed the attached {names}; the message box is as it was.")
