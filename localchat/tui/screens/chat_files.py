"""The chat screen's files for the next message: Ctrl+T asks for a path (a text file, or an
image: the file's first bytes decide), a pasted path of an image file attaches the image,
and Esc takes them all off again. The composer reads and checks each file in a worker and
holds what goes with the message (``Composer``); nothing is stored before it is sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from textual.dom import DOMNode

from localchat.state.images import ImageStore
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.widgets.composer import Composer
from localchat.tui.widgets.image_view import AttachedImage, stored_lines
from localchat.tui.widgets.prompt_input import PromptInput

if TYPE_CHECKING:
    from localchat.tui.state import AppState
    from localchat.tui.widgets.stats_panel import StatsPanel


class AttachesFiles(DOMNode):
    """Mixed into the chat screen, which has the composer, the panel and the app's state."""

    state: AppState
    composer: Composer
    panel: StatsPanel

    @property
    def max_tokens(self) -> int:  # the chat screen's
        raise NotImplementedError

    def read_ahead_box(self) -> None:  # the chat screen's
        raise NotImplementedError

    async def attached_images(self, keys: tuple[str, ...]) -> list[AttachedImage]:
        """Stored images as attachments again (an edited question's), their notes read off
        the app's thread."""
        session = self.state.session
        if not keys or session is None:
            return []
        store = ImageStore(session.paths.images_dir)
        lines = await asyncio.to_thread(stored_lines, store, keys)
        return [AttachedImage(line, key) for line, key in zip(lines, keys, strict=True)]

    def action_attach(self) -> None:
        """Ctrl+T: attach a text file or an image to the next message (Esc removes it)."""
        session = self.state.session
        if session is None or session.backend is None:
            self.app.notify("No model is loaded yet.", severity="warning")
            return

        def chosen(path: str | None) -> None:
            if path:
                self.attach(Path(path).expanduser())

        hint = "its path (a text file or an image) · Ctrl+S attaches · Esc cancels"
        self.app.push_screen(TextPromptScreen("Attach a file or an image", "", hint), chosen)

    def attach(self, path: Path) -> None:
        """Read ``path`` for the next message (a worker: a notice says how it went)."""
        session = self.state.session
        if session is None or session.backend is None:
            self.app.notify("No model is loaded yet.", severity="warning")
            return
        conversation = session.conversation
        system = conversation.record.system_prompt if conversation else None
        self.composer.load_attachment(session, path, system, self.max_tokens)

    def on_prompt_input_image_pasted(self, message: PromptInput.ImagePasted) -> None:
        """A pasted path of an image file (a file dragged onto the terminal): attached."""
        self.attach(message.path)

    def on_composer_attached(self, message: Composer.Attached) -> None:
        self.panel.show_turn_start(
            f"attached {message.names}: goes with your next message (Esc removes)"
        )
        self.read_ahead_box()  # the file is read while the question is typed

    def drop_attachments(self) -> None:
        """Esc: the files and images go, the words in the box stay."""
        names = self.composer.drop_attachments()
        self.panel.show_turn_start("no files attached")
        self.app.notify(
            f"Removed the attached {names}; the message box is as it was.", markup=False
        )
