"""Reaching the OpenAI-compatible servers the user configured: a backend for one, and what
each serves (the Models screen's rows). The server entries come from settings.toml, a layer
above, so they are read through the three fields this needs (``ServerEntry``). The wire
(httpx) is imported only when a server is used: a local start never pays for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from localchat.errors import LocalchatError

if TYPE_CHECKING:
    from localchat.backends.remote import RemoteBackend


class ServerEntry(Protocol):
    """A configured server as this module reads it (``settings.ServerConfig``)."""

    @property
    def name(self) -> str: ...  # its name in settings.toml; empty for a URL given as is

    @property
    def url(self) -> str: ...

    @property
    def key_env(self) -> str | None: ...  # the variable its API key is read from


def connect(
    server: ServerEntry, model: str | None = None, context_size: int | None = None
) -> RemoteBackend:
    """A backend on ``server`` (``Settings.server(spec)``: by name or URL), its key from the
    environment. Network calls: the listing, a count probe."""
    from localchat.backends.remote import RemoteBackend, api_key_from_env

    return RemoteBackend(
        server.url,
        model,
        api_key_from_env(server.key_env),
        name=server.name or None,
        context_size=context_size,
        key_env=server.key_env,
    )


@dataclass(frozen=True)
class ServerModelRow:
    """One model a configured server serves (or why the server could not be listed)."""

    server: str  # the server's name in settings.toml
    model: str | None
    context_size: int | None = None
    problem: str | None = None


def server_model_rows(servers: tuple[ServerEntry, ...]) -> list[ServerModelRow]:
    """What each configured server serves, for the Models screen (network calls: a thread)."""
    rows: list[ServerModelRow] = []
    for server in servers:
        try:
            backend = connect(server)
        except LocalchatError as exc:  # one server down never hides the others, or local models
            rows.append(ServerModelRow(server.name, None, problem=str(exc)))
            continue
        try:
            rows.extend(ServerModelRow(server.name, m.id, m.context_size) for m in backend.models)
        finally:
            backend.close()
    return rows
