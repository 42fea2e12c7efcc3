"""The message being written: the box, the files that go with it (and what each costs), an
earlier message being edited in its place, and the text read ahead while it is typed.

The chat screen gathers the message from it when it is sent (``take_message``), and gives
it back when the send failed (``give_back``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message

from localchat.chat.attachments import Attachment, check_fits, read_attachment, with_attachments
from localchat.conversation.base import ConversationBase
from localchat.conversation.draft_reader import DraftReader
from localchat.errors import LocalchatError, UsageError
from localchat.tui.messages import AttachmentReady, ReadAhead
from localchat.tui.widgets.image_view import AttachedImage, attached_image
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.worker_failures import ReportsWorkerFailures
from localchat.units import format_bytes

if TYPE_CHECKING:  # the session (llama.cpp, the hub client) is imported after the first frame
    from localchat.session import Session


class Composer(ReportsWorkerFailures, Vertical):
    """The message box and what goes with the message it holds. Enter posts the box's
    ``PromptInput.Submitted``, which the screen takes (or turns down, the text kept)."""

    @dataclass
    class Attached(Message):
        """A file goes with the next message: ``names``, every file that does now."""

        names: str

    @dataclass
    class ImageRead(Message, bubble=False):
        """An image file read and checked for the next message (nothing stored yet)."""

        image: AttachedImage

    def __init__(self) -> None:
        super().__init__()
        # Files that go with the next message, and what each costs (counted when it came).
        self.attachments: list[Attachment] = []
        self._attachment_tokens: list[int] = []
        # Images that go with it (stored when it is sent).
        self.images: list[AttachedImage] = []
        # What the last message sent had: a failed send gives it back.
        self._sent: tuple[str, list[Attachment], list[int], list[AttachedImage]] = ("", [], [], [])
        # The message being edited (its id): what is sent replaces it, as a new branch.
        self.editing: int | None = None
        self._box_before_edit = ""
        self._images_before_edit: list[AttachedImage] = []
        # The box's text, read ahead while it is typed (one worker at a time).
        self.reader = DraftReader()

    def compose(self) -> ComposeResult:
        yield PromptInput(id="input", placeholder="Message (Enter sends, Ctrl+J new line)")

    @property
    def box(self) -> PromptInput:
        return self.query_one(PromptInput)

    def focus_box(self) -> None:
        self.box.focus()

    def set_text(self, text: str) -> None:
        """Put ``text`` in the box, the cursor at its end."""
        box = self.box
        box.text = text
        box.move_cursor(box.document.end)

    def steady(self, steady: bool) -> None:
        """A steady cursor while the model answers: each blink is a repaint taken from
        generation."""
        self.box.cursor_blink = not steady

    # -- sending -------------------------------------------------------------------------
    def take_message(self, typed: str) -> tuple[str, tuple[AttachedImage, ...]]:
        """The message to send: ``typed`` with the files attached to it, and its images.
        The box empties and the files go with it (kept, to be given back if the send
        fails)."""
        self._sent = (typed, self.attachments, self._attachment_tokens, self.images)
        text = with_attachments(typed, self.attachments)
        images = tuple(self.images)
        self.attachments, self._attachment_tokens, self.images = [], [], []
        self.box.clear()
        return text, images

    def give_back(self, user_text: str) -> None:
        """The send of ``user_text`` failed: the words go back into an empty box, and the
        files and images it had wait for the next try."""
        typed, attachments, tokens, images = self._sent
        if user_text == with_attachments(typed, attachments):
            self.attachments, self._attachment_tokens = attachments, tokens
            self.images = [*images, *self.images]
            user_text = typed
        if not self.box.text.strip():
            self.box.text = user_text

    # -- editing an earlier message ------------------------------------------------------
    def begin_edit(self, message_id: int, text: str, images: Sequence[AttachedImage] = ()) -> None:
        """Edit message ``message_id`` (its ``text`` in the box, its ``images`` attached);
        what the box held comes back if the edit is cancelled."""
        if self.editing is None:
            self._box_before_edit = self.box.text
            self._images_before_edit = self.images
        self.editing = message_id
        self.images = list(images)
        self.set_text(text)
        self.focus_box()

    def take_edit(self) -> int | None:
        """The message the one being sent replaces (None: it follows the last)."""
        edited, self.editing = self.editing, None
        return edited

    def end_edit(self) -> None:
        """Stop editing: the box gets back what it held before the edit began."""
        if self.editing is not None:
            self.editing = None
            self.images = self._images_before_edit
            self.set_text(self._box_before_edit)

    # -- attachments ---------------------------------------------------------------------
    @work(thread=True, exit_on_error=False, group="attach")
    def load_attachment(
        self, session: Session, path: Path, system: str | None, max_tokens: int
    ) -> None:
        """Read the file and count its tokens (the model's tokenizer, or the server's) and
        the system prompt's (``system``: what the conversation had when it was chosen); an
        image is read and checked whole (stored when the message is sent)."""
        from localchat.chat.image_files import is_image_path, read_image_file

        try:
            if is_image_path(path):
                image = attached_image(path, read_image_file(path))
                self.post_message(self.ImageRead(image))
                return
            attachment = read_attachment(path)
            backend = session.backend
            if backend is None:
                raise UsageError("no model is loaded yet")
            tokens = backend.count_tokens(attachment.block())
            head = backend.count_tokens(system) if system else 0
        except LocalchatError as exc:
            self.app.call_from_thread(
                self.notify,
                str(exc),
                title="Not attached",
                severity="error",
                timeout=15,
                markup=False,
            )
            return
        n_ctx = backend.context_size  # what the context holds: decided where it is attached
        self.post_message(AttachmentReady(attachment, tokens, head, n_ctx, max_tokens))

    def on_attachment_ready(self, message: AttachmentReady) -> None:
        """The file goes with the next message where the context holds it with the others,
        the system prompt and a reply."""
        if not self.is_mounted or not self.app.is_running:
            return
        pending = [*self.attachments, message.attachment]
        costs = [*self._attachment_tokens, message.tokens]
        try:
            check_fits(pending, sum(costs), message.head_tokens, message.n_ctx, message.max_tokens)
        except LocalchatError as exc:
            self.notify(str(exc), title="Not attached", severity="error", timeout=15, markup=False)
            return
        self.attachments, self._attachment_tokens = pending, costs
        self.post_message(self.Attached(self.attached_names()))
        self.notify(f"Attached {message.attachment.name}: {message.tokens:,} tokens.", markup=False)
        self.focus_box()

    def on_composer_image_read(self, message: ImageRead) -> None:
        """The image goes with the next message (stored when it is sent)."""
        if not self.is_mounted or not self.app.is_running:
            return
        self.images.append(message.image)
        self.post_message(self.Attached(self.attached_names()))
        line = message.image.line
        self.notify(
            f"Attached {line.name}: {line.width}×{line.height} px, {format_bytes(line.size_bytes)}.",
            markup=False,
        )
        self.focus_box()

    @property
    def has_attachments(self) -> bool:
        return bool(self.attachments or self.images)

    def attached_names(self) -> str:
        """Every file and image that goes with the next message, by name."""
        names = [a.name for a in self.attachments] + [i.line.name for i in self.images]
        return ", ".join(names)

    def drop_attachments(self) -> str:
        """The files and images go, the words in the box stay; the names dropped."""
        names = self.attached_names()
        self.attachments, self._attachment_tokens, self.images = [], [], []
        return names

    # -- reading ahead -------------------------------------------------------------------
    def has_draft(self) -> bool:
        """Something to read ahead: words in the box, or files."""
        return bool(self.box.text.strip() or self.has_attachments)

    def read_ahead(self, conversation: ConversationBase, max_tokens: int) -> None:
        """Read the message as it stands ahead into ``conversation``'s cache (``ReadAhead``
        says how far); not while an edit replaces an earlier message, nor with images
        (they go before the text: both are read when sent)."""
        if self.editing is not None or self.images:
            return
        if self.reader.offer(conversation, with_attachments(self.box.text, self.attachments)):
            self._read_ahead(self.reader, max_tokens)

    @work(thread=True, exit_on_error=False, group="read-ahead")
    def _read_ahead(self, reader: DraftReader, max_tokens: int) -> None:
        """Read the box's newest text ahead until it is read (see ``DraftReader``)."""

        def report(conversation_id: str, tokens: int, kv_tokens: int) -> None:
            self.post_message(ReadAhead(conversation_id, tokens, kv_tokens))

        reader.run(max_tokens, report)
