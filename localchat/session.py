"""The lifecycle of a chat, without Textual: which backend answers (a model loaded here or a
server), the conversation open on it, and closing both in order. The CLI's ``ask`` and the
app use it alike; the app runs its blocking calls in threads and only draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from localchat.backend import Backend
from localchat.conversation import Conversation, ConversationBase
from localchat.engine import Engine
from localchat.errors import LocalchatError
from localchat.kvstate import StateStore
from localchat.paths import AppPaths
from localchat.settings import ServerConfig, Settings
from localchat.store import Store

if TYPE_CHECKING:  # the wire (httpx) is imported only when a server is used
    from localchat.remote import RemoteBackend


def connect(
    settings: Settings, spec: str, model: str | None = None, context_size: int | None = None
) -> RemoteBackend:
    """A server by URL or by its name in settings.toml, its key from the environment."""
    from localchat.remote import RemoteBackend, api_key_from_env

    server = settings.server(spec)
    return RemoteBackend(
        server.url,
        model,
        api_key_from_env(server.key_env),
        name=server.name or None,
        context_size=context_size,
    )


@dataclass(frozen=True)
class ServerModelRow:
    """One model a configured server serves (or why the server could not be listed)."""

    server: str  # the server's name in settings.toml
    model: str | None
    context_size: int | None = None
    problem: str | None = None


def server_model_rows(servers: tuple[ServerConfig, ...]) -> list[ServerModelRow]:
    """What each configured server serves, for the Models screen (network calls: a thread)."""
    from localchat.remote import RemoteBackend, api_key_from_env

    rows: list[ServerModelRow] = []
    for server in servers:
        try:
            backend = RemoteBackend(server.url, api_key=api_key_from_env(server.key_env))
        except LocalchatError as exc:
            rows.append(ServerModelRow(server.name, None, problem=str(exc)))
            continue
        try:
            rows.extend(ServerModelRow(server.name, m.id, m.context_size) for m in backend.models)
        finally:
            backend.close()
    return rows


def open_on(
    backend: Backend,
    store: Store,
    states: StateStore,
    name: str,
    system_prompt: str | None = None,
    wait_s: float = 0.0,
    window_mode: str = "auto",
) -> ConversationBase:
    """Open (or start) ``name`` on ``backend``: the conversation kind that backend needs."""
    if isinstance(backend, Engine):
        return Conversation.open(
            store, states, name, backend, system_prompt, window_mode=window_mode, wait_s=wait_s
        )
    from localchat.remote import RemoteBackend
    from localchat.remote_conversation import RemoteConversation

    if isinstance(backend, RemoteBackend):
        return RemoteConversation.open(store, states, name, backend, system_prompt, wait_s=wait_s)
    raise TypeError(f"no conversation for a {type(backend).__name__}")


class Session:
    """One backend and at most one open conversation on it, over the user's stores."""

    def __init__(self, paths: AppPaths, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.store = Store(paths.database)
        self.states = StateStore(paths.states_dir, settings.state_budget_bytes)
        self.backend = backend
        self.conversation: ConversationBase | None = None

    def open_conversation(
        self,
        name: str,
        system_prompt: str | None = None,
        wait_s: float = 0.0,
        window_mode: str | None = None,
    ) -> ConversationBase:
        """Open (or start) ``name`` on this session's backend; the one open before closes."""
        self.close_conversation()
        self.conversation = open_on(
            self.backend,
            self.store,
            self.states,
            name,
            system_prompt,
            wait_s,
            window_mode or self.settings.window_mode,
        )
        return self.conversation

    def close_conversation(self) -> None:
        conversation, self.conversation = self.conversation, None
        if conversation is not None:
            conversation.close()

    def close(self) -> None:
        """The conversation (its state saves finish), then the store, then the backend."""
        try:
            self.close_conversation()
        finally:
            self.store.close()
            self.backend.close()
