"""Images a request sends, as every API writes them (base64 in its JSON: a data URI, or
the bare base64 with its media type beside it), checked and put in the data folder's image
store, so that a message names its images by key, as the app's messages do.

An adapter reads a request on the event loop: it only collects each image's base64 text
(``ImageIntake``) and puts a placeholder in the message; ``with_images`` then decodes and
checks them (``inspect_image``: Pillow decodes every pixel) and stores them on a worker
thread, and the placeholders become the keys. An image given by URL is refused: this
server fetches nothing from the network (a client sends the image itself).

The store is content-addressed: an image sent again (every request of a conversation
resends it) is written once, and its id, which its placeholder ids in the prompt cache are
made of, stays the same across restarts. Nothing but a kept response refers to a served
image after its request, so the store is swept as images come in (at most hourly): an image
no message or kept response shows, unsent for a day (``SERVED_KEEP_S``), is deleted. Its id stays,
so the same image sent again is stored again and still meets its cached prompt.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from localchat.chat.image_files import MAX_IMAGE_BYTES, ImageRejected, inspect_image
from localchat.chat.template import ChatMessage
from localchat.errors import LocalchatError
from localchat.server.requests import GenerationRequest, SentImage, bad
from localchat.state.images import ImageStore, delete_unreferenced
from localchat.state.store import Store

_log = logging.getLogger(__name__)
PENDING = "sent:"  # a placeholder key: the request's n-th image, not yet stored
_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.I)
_MAX_BASE64 = (MAX_IMAGE_BYTES + 2) // 3 * 4 + 1024  # past this the image is too large
_STORES: dict[Path, ImageStore] = {}
_STORES_LOCK = threading.Lock()
SWEEP_EVERY_S = 3600.0
# A served image unsent this long is swept: longer than any request runs (its images are
# read while it runs), and a kept response's images are referenced, so never swept.
SERVED_KEEP_S = 24 * 3600.0
_SWEPT_AT: dict[Path, float] = {}  # the data folder's last sweep, by its image folder
URL_REFUSED = (
    "this server does not fetch images from URLs; send the image itself as a data URI"
    " (data:image/png;base64,...)"
)


class ImageIntake:
    """The images of one request, collected while its body is read."""

    def __init__(self) -> None:
        self.sent: list[SentImage] = []

    def url(self, value: Any, where: str) -> str:
        """An ``image_url``'s URL: a data URI (anything else refused, naming ``where``);
        the placeholder key the message holds until the image is stored."""
        if not isinstance(value, str):
            raise bad(f"{where} must be a data URI (data:image/png;base64,...)", "invalid_type")
        if value[:8].lower().startswith(("http://", "https://")):
            raise bad(f"{where}: {URL_REFUSED}", "unsupported_content")
        found = _DATA_URI.match(value[:256])  # the head only: a bad 8 MB field costs no scan
        if found is None:
            raise bad(f"{where} must be a data URI of an image: data:image/<type>;base64,<data>")
        return self.base64(value[found.end() :], where)

    def base64(self, value: Any, where: str) -> str:
        """An image's base64 text (no data URI around it); its placeholder key."""
        if not isinstance(value, str) or not value:
            raise bad(f"{where} must be an image's bytes in base64", "invalid_type")
        self.sent.append(SentImage(value, where))
        return f"{PENDING}{len(self.sent) - 1}"


def image_store() -> ImageStore:
    """The data folder's image store (the one the models' projectors read from)."""
    from localchat.paths import app_paths

    directory = app_paths().images_dir
    with _STORES_LOCK:
        store = _STORES.get(directory)
        if store is None:
            store = _STORES[directory] = ImageStore(directory)
        return store


def _decoded(sent: SentImage) -> bytes:
    """The image's bytes; a 400 naming its field where the base64 is not valid."""
    if len(sent.data) > _MAX_BASE64:
        raise bad(f"{sent.where} is over {MAX_IMAGE_BYTES // 2**20} MiB: larger than an"
                  " image may be; send it smaller (JPEG, or scaled down)")  # fmt: skip
    try:
        return base64.b64decode(sent.data, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:  # base64 wrapped over lines
        return base64.b64decode("".join(sent.data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{sent.where} is not valid base64: send the image's bytes base64-encoded",
                  "invalid_image") from None  # fmt: skip


def store_sent(sent: Sequence[SentImage]) -> list[str]:
    """Decode, check and store each image (blocking: a worker thread's); their keys. A
    400 naming the field where one is not an image or too large (``ImageRejected``)."""
    keys = []
    for image in sent:
        data = _decoded(image)
        try:
            facts = inspect_image(data, image.where)
        except ImageRejected as exc:
            raise bad(str(exc), "invalid_image") from None
        keys.append(image_store().put(facts).key)
    sweep_if_due()
    return keys


def sweep_if_due(every_s: float = SWEEP_EVERY_S) -> list[str]:
    """Delete the images nothing refers to where the last sweep of this data folder is
    ``every_s`` old (or none was made by this process); the keys deleted."""
    from localchat.paths import app_paths

    paths = app_paths()
    now = time.monotonic()
    with _STORES_LOCK:
        last = _SWEPT_AT.get(paths.images_dir)
        if last is not None and now - last < every_s:
            return []
        _SWEPT_AT[paths.images_dir] = now
    try:
        store = Store(paths.database)
        try:
            return delete_unreferenced(store, image_store(), keep_recent_s=SERVED_KEEP_S)
        finally:
            store.close()
    except (LocalchatError, OSError, sqlite3.Error) as exc:  # the request it rode on is served
        _log.warning("could not sweep the unreferenced images: %s", exc)
        return []


def resolved(messages: list[ChatMessage], keys: Sequence[str]) -> list[ChatMessage]:
    """``messages`` with their placeholder keys replaced by the stored images' keys."""

    def key(given: str) -> str:
        return keys[int(given[len(PENDING) :])] if given.startswith(PENDING) else given

    return [replace(m, images=tuple(key(k) for k in m.images)) if m.images else m for m in messages]


async def with_images(request: GenerationRequest) -> GenerationRequest:
    """``request`` with the images it sent stored (on a worker thread) and its messages
    naming them by key; as it is where it sent none."""
    if not request.sent_images or request.messages is None:
        return request
    keys = await run_in_threadpool(store_sent, request.sent_images)
    return replace(request, messages=resolved(request.messages, keys), sent_images=())


def image_parts_refused(role: str, where: str) -> None:
    """Images go in what a user or a tool says (a tool may answer with a screenshot, as
    llama-server takes it); an assistant's or a system prompt's images are refused."""
    if role not in ("user", "tool"):
        raise bad(f"{where}: images go in user or tool messages, not {role} ones",
                  "invalid_value")  # fmt: skip
