"""The images a message shows, put in the data folder's store for it: one way for ``ask``
and the app alike."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from localchat.backends.base import Backend
from localchat.errors import UsageError
from localchat.state.images import ImageStore

if TYPE_CHECKING:  # Pillow is imported where an image file is read
    from localchat.chat.image_files import ImageFacts


def stored_images(
    backend: Backend, directory: Path, images: Sequence[ImageFacts | str]
) -> tuple[str, ...]:
    """The keys of ``images`` (checked bytes, or keys stored already), each put in the store
    once, by its bytes' hash, once ``backend`` is known to read them: one that cannot is
    refused before anything is kept."""
    if not images:
        return ()
    refused = backend.images_refused()
    if refused:
        raise UsageError(refused)
    store = ImageStore(directory)
    try:
        return tuple(i if isinstance(i, str) else store.put(i).key for i in images)
    finally:
        store.close()
