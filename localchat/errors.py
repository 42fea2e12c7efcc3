"""Errors that reach the user as one line: what is wrong and what to do."""

from __future__ import annotations


class LocalchatError(Exception):
    """Base for every error the CLI and UI show as a one-line message (never a traceback)."""


class ModelFileError(LocalchatError):
    """A model file is missing, not GGUF, truncated or otherwise unusable."""


class ModelLoadError(LocalchatError):
    """llama.cpp refused to load a model or create its context."""


class UsageError(LocalchatError):
    """An argument or setting has a value localchat cannot use."""


class WorldError(LocalchatError):
    """Not the user's mistake: the network, a server or the disk failed (exit code 1)."""


def one_line(error: BaseException) -> str:
    """What an error says, in one line: a system error with the file it is about."""
    if isinstance(error, OSError) and not isinstance(error, LocalchatError):
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror or error}{where}"
    text = " ".join(str(error).split())
    return text or type(error).__name__
