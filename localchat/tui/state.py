"""What the app holds and its chat screen reads: the session once it is open, the user's
settings, the options the app was started with, and whether it is quitting. One object,
the app's, handed to the chat screen when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localchat.backends.base import Sampling
from localchat.settings import Settings

if TYPE_CHECKING:  # the session (llama.cpp, the hub client) is imported after the first frame
    from localchat.session import Session


@dataclass
class AppState:
    settings: Settings = field(default_factory=Settings)
    session: Session | None = None  # the lifecycle: backend, stores, the open conversation
    sampling: Sampling | None = None
    max_tokens: int | None = None
    system_prompt: str | None = None
    quitting: bool = False
