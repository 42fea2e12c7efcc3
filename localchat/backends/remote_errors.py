"""What goes wrong with a server, as errors that name it: one set for the backend's requests
and for a reply that fails mid-stream."""

from __future__ import annotations

from localchat.errors import UsageError, WorldError

# How much of the server's own words an error quotes.
ERROR_TEXT_LIMIT = 160


class RemoteError(WorldError):
    """The server or the network failed (exit code 1); the message names the server."""


class ServerRefused(UsageError):
    """The server refused what the user asked for: the key, the model, the URL (exit 2)."""


class ContextExceeded(RemoteError):
    """The server said the prompt does not fit; ``limit`` is its context where it said so."""

    def __init__(self, message: str, limit: int | None) -> None:
        super().__init__(message)
        self.limit = limit
