"""Typed messages that thread workers post back to the app (workers never touch widgets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from textual.message import Message

from localchat.backends.base import Backend, TurnStats
from localchat.chat.attachments import Attachment
from localchat.conversation.turn import FinishedTurn
from localchat.progress import Progress, StepProgress

if TYPE_CHECKING:  # the session is imported in a worker, after the first frame
    from localchat.session import Session
    from localchat.settings import Settings


@dataclass
class SessionOpened(Message):
    """The session is open (its stores, or none where the database could not be opened:
    ``error`` says why); ``settings`` as read from the user's file."""

    session: Session
    settings: Settings
    error: str | None = None


@dataclass
class ModelLoaded(Message):
    """What answers from now on: a model loaded here, or a server connected to."""

    backend: Backend
    load_s: float


@dataclass
class ModelLoadFailed(Message):
    error: str


@dataclass
class ReplyChunk(Message, bubble=False):  # the chat screen's own
    """Text generated since the last chunk (the answer, and a reasoning model's thinking
    apart), with a copy of the stats so far (the worker keeps changing its own)."""

    text: str
    stats: TurnStats
    kv_tokens: int
    reasoning: str = ""
    ttft_s: float = 0.0  # from the message being sent (Enter) to the first token


@dataclass
class ReplyFinished(Message, bubble=False):  # the chat screen's own
    """The turn is over: ``turn`` is what it came to, built on the compute thread where it
    ran (the app's thread reads it, never the conversation's database)."""

    turn: FinishedTurn
    kv_tokens: int

    @property
    def stats(self) -> TurnStats:
        """A copy of the figures the turn ended with."""
        return self.turn.stats


@dataclass
class ReplyFailed(Message, bubble=False):  # the chat screen's own
    """The turn could not run; ``user_text`` goes back into the input so nothing is lost."""

    error: str
    user_text: str


@dataclass
class ModelChosen(Message):
    """The model file to load (found on disk, downloaded, or given)."""

    path: Path


@dataclass
class ModelMissing(Message):
    """Nothing on disk and the hub unreachable: the user chooses the demo or a file."""

    reason: str


@dataclass
class StartupNotice(Message):
    """What the first start decided (which quant the planner chose here, and why)."""

    text: str


@dataclass
class StartupProgress(Message):
    """The first start's download, as it goes."""

    progress: Progress


@dataclass
class StartupWarning(Message):
    """Something the start skipped or fell back on, and why (one line)."""

    text: str


@dataclass
class StartupStep(Message):
    """A step of the first start (the check, the speed calibration), as it goes."""

    step: StepProgress


@dataclass
class ReadAhead(Message):  # from the composer, up to the chat screen
    """The message being typed in conversation ``conversation_id`` is read ahead: ``tokens``
    of it are in the cache, which holds ``kv_tokens`` in all."""

    conversation_id: str
    tokens: int
    kv_tokens: int


@dataclass
class AttachmentReady(Message, bubble=False):  # the composer's own
    """A file read for the next message: ``tokens`` is what it costs in the context,
    ``head_tokens`` what the system prompt takes; ``n_ctx`` the context, and ``max_tokens``
    the room a reply needs in it."""

    attachment: Attachment
    tokens: int
    head_tokens: int
    n_ctx: int | None
    max_tokens: int


@dataclass
class ConversationRestored(Message, bubble=False):  # the chat screen's own
    """An opened conversation's saved cache is in memory: its first turn starts warm."""

    tokens: int  # what the cache holds now
    seconds: float
