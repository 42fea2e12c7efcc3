"""The lifecycle of a chat, without Textual: which backend answers (a model loaded here or a
server), the conversation open on it, and closing both in order. The CLI's ``ask`` and the
app use it alike; the app runs its blocking calls in threads and only draws.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from localchat.backends.base import Backend
from localchat.backends.compute_thread import run_compute
from localchat.conversation.base import ConversationBase
from localchat.conversation.opening import open_on
from localchat.conversation.records import fork_conversation
from localchat.errors import UsageError
from localchat.paths import AppPaths
from localchat.settings import Settings
from localchat.state.kvstate import StateStore
from localchat.state.store import ConversationRecord, Store
from localchat.tools.toolbox import ToolBox


class Session:
    """One backend and at most one open conversation on it, over the user's stores.

    The app opens and closes conversations in threads while it may be quitting: once
    ``close`` began, a late open does nothing, and ``close`` waits (bounded) for one in
    flight, so the database is never closed under it.
    """

    def __init__(
        self,
        paths: AppPaths,
        settings: Settings,
        backend: Backend | None = None,
        open_stores: bool = True,
    ) -> None:
        """``open_stores=False``: no conversations (the database could not be opened)."""
        self.paths = paths
        self.settings = settings
        self.backend: Backend | None = backend
        self.store: Store | None = None
        self.states: StateStore | None = None
        self.conversation: ConversationBase | None = None
        self.closing = False
        self._io = threading.Lock()
        # The tools replies are offered: the MCP servers, started on first use.
        self.tools = ToolBox(settings.mcp, paths.logs_dir, settings.tool_result_chars)
        if open_stores:
            self.store = Store(paths.database)
            self.states = StateStore(paths.states_dir, settings.state_budget_bytes)

    # -- tools -----------------------------------------------------------------------------------
    def start_tools(self, on_late: Callable[[str], object] | None = None) -> list[str]:
        """Start the MCP servers settings.toml configures (``ToolBox.start``) and offer their
        tools to the open conversation; one that answers later is offered from then on, and
        ``on_late`` gets a line saying so."""

        def late(name: str) -> None:  # on the servers' loop, which must not wait on a turn
            line = f"MCP server {name!r} answered late: its tools are offered from now on"
            threading.Thread(target=self._offer_tools, args=(line, on_late), daemon=True).start()

        if self.tools.servers is not None or not self.tools.configs:
            return []
        problems = self.tools.start(late)
        self._offer_tools()  # a conversation opened meanwhile is offered them now
        return problems

    def _offer_tools(self, line: str = "", say: Callable[[str], object] | None = None) -> None:
        """Offer the open conversation the tools as they are now (then ``say`` ``line``)."""
        with self._io:
            if self.conversation is not None:
                run_compute(self.conversation.offer_tools, self.tools.use())
        if say is not None:
            say(line)

    def turn_tool(self, name: str, on: bool) -> None:
        """Offer a tool to the replies or stop offering it (the open conversation's next
        turn re-reads its history: the tools render at the prompt's head)."""
        self.tools.turn(name, on)
        if self.conversation is not None:
            run_compute(self.conversation.offer_tools, self.tools.use())

    def use(self, backend: Backend) -> Backend | None:
        """Answer with ``backend`` from now on; returns the previous one for the caller to
        free (a local model on the compute thread). Close the conversation first."""
        previous, self.backend = self.backend, backend
        return previous

    # -- conversations ----------------------------------------------------------------------
    def new_conversation_name(self) -> str:
        """A fresh name: the time, with a counter when two chats start in the same second."""
        base = time.strftime("chat-%Y%m%d-%H%M%S")
        return base if self.store is None else self.store.free_name(base)

    def open_conversation(
        self,
        name: str | None = None,
        system_prompt: str | None = None,
        wait_s: float = 0.0,
        window_mode: str | None = None,
    ) -> ConversationBase | None:
        """Open (or start) ``name`` on the backend — by default the most recent conversation,
        else a new one; the one open before closes. None without a backend or a database, or
        once the session began to close."""
        with self._io:
            if self.closing or self.backend is None or self.store is None or self.states is None:
                return None
            self._close_conversation()
            if name is None:
                recent = self.store.conversations()
                name = recent[0].name if recent else self.new_conversation_name()
            conversation = open_on(
                self.backend,
                self.store,
                self.states,
                name,
                system_prompt,
                wait_s,
                window_mode or self.settings.window_mode,
                self.settings.prefix_state_min_tokens,
            )
            if self.closing:  # ``close`` gave up waiting for this open: nothing is kept
                conversation.close()
                return None
            conversation.offer_tools(self.tools.use())
            self.conversation = conversation
            return conversation

    def close_conversation(self) -> None:
        """Close the open conversation (its last state save finishes first)."""
        with self._io:
            self._close_conversation()

    def fork(self, message_id: int) -> tuple[ConversationRecord, int]:
        """``localchat branch`` from the open conversation: a new conversation holding its
        messages up to ``message_id`` (a question: up to before it, to be asked again),
        whose first turn restores them from this one's saved cache. Blocking: a thread.
        Returns it and the position it was forked at."""
        conversation = self.conversation
        if conversation is None or self.store is None or self.states is None:
            raise UsageError("no conversation is open")
        index = conversation.index_of(message_id)
        at = index + 1 if conversation.exchanges[index].record.role == "assistant" else index
        conversation.wait_saved()  # its last state is the source
        fork, _caches = fork_conversation(self.store, self.states, conversation.record.name, at)
        return fork, at

    def _close_conversation(self) -> None:
        # No longer the session's before it closes: nothing starts a turn on it meanwhile.
        conversation, self.conversation = self.conversation, None
        if conversation is not None:
            conversation.close()

    def close(
        self, wait_s: float | None = None, free_backend: bool = True, quitting: bool = False
    ) -> bool:
        """The conversation (its state saves finish), then the store, then the backend unless
        the caller frees it (``quitting``: a server's client is closed, a local model goes
        with the process). ``wait_s`` bounds the wait for an open or close in flight;
        False if it ran out (the database is then closed anyway, after that one)."""
        if quitting and self.backend is not None:
            free_backend = not self.backend.frees_with_process
        self.closing = True
        self.tools.close()
        held = self._io.acquire(timeout=-1 if wait_s is None else wait_s)
        try:
            self._close_conversation()
            if self.store is not None:
                self.store.close()
        finally:
            if held:
                self._io.release()
            if free_backend and self.backend is not None:
                self.backend.close()
        return held
