"""A turn, as the chat screen's worker runs it on the compute thread: the reply posted in
chunks as it comes, and what the turn came to (``FinishedTurn``, built there) when it ends;
and the line that says how it began."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from textual.message import Message

from localchat.backends.base import Sampling, TurnStats
from localchat.chat.template import ChatMessage
from localchat.conversation.base import ConversationBase
from localchat.conversation.turn import ConversationTurn, FinishedTurn
from localchat.errors import LocalchatError, UsageError
from localchat.tui.messages import ReplyChunk, ReplyFailed, ReplyFinished
from localchat.tui.pacing import MIN_INTERVAL_S
from localchat.tui.widgets.image_view import AttachedImage, stored_lines
from localchat.units import count

if TYPE_CHECKING:  # Pillow is imported where an image is read, in a worker
    from localchat.chat.image_files import ImageFacts

# A question's images: checked bytes to store, or the keys of images stored already.
ImageSources: TypeAlias = "tuple[ImageFacts | str, ...]"
# The worker posts text at most this often; the pacer decides which chunks get drawn at once.
CHUNK_INTERVAL_S = MIN_INTERVAL_S


@dataclass(frozen=True)
class TurnRequest:
    """A turn to run: the user's ``text`` (sent at ``entered_at``, on ``perf_counter``'s
    clock), or the ``results`` of the last reply's calls (``text`` then empty). ``images``:
    what the question shows, each checked bytes to store (in ``images_dir``) or the key of
    an image stored already."""

    conversation: ConversationBase
    text: str
    entered_at: float
    sampling: Sampling
    max_tokens: int
    results: list[ChatMessage] | None = None
    images: ImageSources = ()
    images_dir: Path | None = None


def stream_turn(
    request: TurnRequest,
    cancel: threading.Event,
    post: Callable[[Message], object],
    fail: Callable[[str], None],
) -> TurnStats | None:
    """One turn, on the compute thread: posts the reply as it comes, in chunks, then
    ``ReplyFinished`` (``ReplyFailed``: it never started, and None is returned). ``fail``
    tells the user that generation broke off (the turn still commits what it wrote)."""
    conversation = request.conversation
    try:
        turn = _start(request, cancel)
    except LocalchatError as exc:
        post(ReplyFailed(str(exc), request.text))
        return None
    except Exception as exc:  # the app stays up whatever the runtime raises
        post(ReplyFailed(f"unexpected error: {exc}", request.text))
        return None
    pending = thinking = ""
    last_post = time.perf_counter()
    try:
        for delta in turn:
            if delta.reasoning:
                thinking += delta.text
            else:
                pending += delta.text
            now = time.perf_counter()
            if now - last_post >= CHUNK_INTERVAL_S:
                post(_chunk(conversation, turn, pending, thinking))
                pending = thinking = ""
                last_post = now
    except Exception as exc:
        fail(f"generation failed: {exc}")
    if pending or thinking:
        post(_chunk(conversation, turn, pending, thinking))
    try:  # here, not on the app's thread: it reads the database
        finished = turn.finished(branches=request.results is None)
    except Exception:  # the store failed under it: the reply is drawn, its branches not
        finished = turn.finished(branches=False)
    post(ReplyFinished(finished, conversation.context_tokens(turn)))
    return finished.stats


def _start(request: TurnRequest, cancel: threading.Event) -> ConversationTurn:
    conversation, sampling, max_tokens = request.conversation, request.sampling, request.max_tokens
    if request.results is not None:
        return conversation.send_results(request.results, sampling, max_tokens, cancel)
    images = _stored_images(request)
    return conversation.send(
        request.text, sampling, max_tokens, cancel, entered_at=request.entered_at, images=images
    )


def _stored_images(request: TurnRequest) -> tuple[str, ...]:
    """The question's images, stored once the model is known to read them."""
    if not request.images:
        return ()
    if request.images_dir is None:
        raise UsageError("images need the data folder's image store")
    from localchat.conversation.images import stored_images

    return stored_images(request.conversation.backend, request.images_dir, request.images)


def _chunk(
    conversation: ConversationBase, turn: ConversationTurn, text: str, thinking: str
) -> ReplyChunk:
    """Text since the last chunk, with a copy of the figures (the turn keeps changing its
    own)."""
    kv_tokens = conversation.context_tokens(turn)
    return ReplyChunk(text, replace(turn.stats), kv_tokens, thinking, turn.sent_ttft_s)


def describe_turn_start(turn: FinishedTurn) -> str:
    """How the turn began: restored from disk, reused from memory, or evaluated."""
    stats = turn.stats
    restore = turn.restore
    if stats.kv_bytes_used is None:  # a server: it reads the prompt, reusing its own cache
        about = "" if stats.counted == "server" else "≈"
        return (
            f"sent {about}{count(stats.prompt_tokens, 'token')}; the server answered in"
            f" {stats.ttft_s:.2f} s"
        )
    evaluated = f"evaluated {count(stats.prompt_tokens_evaluated, 'token')} in {stats.ttft_s:.2f} s"
    if restore.read_ahead:
        ahead = count(restore.read_ahead, "token")
        evaluated = f"read {ahead} ahead as you typed; after Enter {evaluated}"
    if turn.history_reread:
        # The template rewrote part of the history (see the stats' reason).
        evaluated += f"\n({count(turn.history_reread, 'history token')} re-read: template)"
    if restore.restored:
        restored = count(restore.tokens, "token")
        return f"restored {restored} from saved cache in {restore.seconds:.2f} s\n{evaluated}"
    if restore.replayed:
        replayed = count(restore.replayed, "token")
        return f"re-evaluated {replayed} in {restore.seconds:.2f} s\n{evaluated}"
    reused = stats.prompt_tokens - stats.prompt_tokens_evaluated - restore.read_ahead
    return evaluated + (f"\nreused {reused:,} from the cache" if reused > 0 else "")


def take_back_last(
    conversation: ConversationBase, images_dir: Path | None
) -> tuple[str, None, tuple[AttachedImage, ...]] | None:
    """Off the app's thread: the last question taken back to be asked again (None: there is
    none), with the images it showed (stored already: their notes read here)."""
    questions = [e.record for e in conversation.exchanges if e.record.role == "user"]
    text = conversation.take_back_last_exchange()
    if text is None:
        return None
    keys = questions[-1].images if questions else ()
    if not keys or images_dir is None:
        return text, None, ()
    from localchat.state.images import ImageStore

    lines = stored_lines(ImageStore(images_dir), keys)
    return (
        text,
        None,
        tuple(AttachedImage(line, key) for line, key in zip(lines, keys, strict=True)),
    )
