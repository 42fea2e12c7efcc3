"""Which conversation a backend is chatted with: a local model's (``Conversation``: its KV
cache held and saved here) or a server's (``RemoteConversation``: the server keeps its own).
The choice is made here, in the layer that holds both kinds, so the session and the app
hold a ``Backend`` and never ask which one it is.
"""

from __future__ import annotations

from localchat.backends.base import Backend
from localchat.backends.llama.engine import Engine
from localchat.conversation.base import ConversationBase
from localchat.conversation.local import Conversation
from localchat.conversation.prefix_states import DEFAULT_MIN_TOKENS
from localchat.state.kvstate import StateStore
from localchat.state.store import Store


def open_on(
    backend: Backend,
    store: Store,
    states: StateStore,
    name: str,
    system_prompt: str | None = None,
    wait_s: float = 0.0,
    window_mode: str = "auto",
    prefix_min_tokens: int = DEFAULT_MIN_TOKENS,
) -> ConversationBase:
    """Open (or start) ``name`` on ``backend``: the conversation kind that backend needs."""
    if isinstance(backend, Engine):
        return Conversation.open(
            store,
            states,
            name,
            backend,
            system_prompt,
            window_mode=window_mode,
            wait_s=wait_s,
            prefix_min_tokens=prefix_min_tokens,
        )
    # The wire (httpx) is imported only when a server is used.
    from localchat.backends.remote import RemoteBackend
    from localchat.conversation.remote import RemoteConversation

    if isinstance(backend, RemoteBackend):
        return RemoteConversation.open(store, states, name, backend, system_prompt, wait_s=wait_s)
    raise TypeError(f"no conversation for a {type(backend).__name__}")
