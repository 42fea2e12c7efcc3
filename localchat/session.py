"""The lifecycle of a chat, without Textual: which backend answers (a model loaded here or a
server), the conversation open on it, and closing both in order. The CLI's ``ask`` and the
app use it alike; the app runs its blocking calls in threads and only draws.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localchat.backends.base import Backend, Reply, Sampling, TokenDelta, TurnStats
from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.engine import Engine
from localchat.chat.tools import ToolUse
from localchat.conversation.base import ConversationBase
from localchat.conversation.local import Conversation
from localchat.conversation.prefix_states import (
    DEFAULT_MIN_TOKENS,
    prefix_spans,
    start_from_prefix,
)
from localchat.conversation.records import fork_conversation
from localchat.conversation.turn import RestoreReport, turn_stats_dict
from localchat.errors import LocalchatError, UsageError
from localchat.gguf.estimate import ModelDims
from localchat.models.speed import attention_work, token_work
from localchat.models.speed_feedback import TurnSpeed, note_turn
from localchat.paths import AppPaths
from localchat.settings import ServerConfig, Settings
from localchat.state.kvstate import StateStore
from localchat.state.store import ConversationRecord, Store
from localchat.tools.toolbox import ToolBox

if TYPE_CHECKING:  # the wire (httpx) is imported only when a server is used
    from localchat.backends.remote import RemoteBackend
    from localchat.chat.template import ChatMessage


def connect(
    settings: Settings, spec: str, model: str | None = None, context_size: int | None = None
) -> RemoteBackend:
    """A server by URL or by its name in settings.toml, its key from the environment."""
    return _server_backend(settings.server(spec), model, context_size)


def _server_backend(
    server: ServerConfig, model: str | None = None, context_size: int | None = None
) -> RemoteBackend:
    from localchat.backends.remote import RemoteBackend, api_key_from_env

    return RemoteBackend(
        server.url,
        model,
        api_key_from_env(server.key_env),
        name=server.name or None,
        context_size=context_size,
        key_env=server.key_env,
    )


def note_turn_speed(paths: AppPaths, backend: Backend, stats: TurnStats) -> str | None:
    """Count a local CPU turn's speed against the calibration (speed_feedback.py); a notice
    when the figures were updated. Servers and GPU offload are not what it measures."""
    if not isinstance(backend, Engine) or backend.options.n_gpu_layers:
        return None
    if stats.drafted_tokens:  # drafts sped it up: not what the calibration predicts
        return None
    filled = stats.prompt_tokens + stats.generated_tokens // 2
    turn = TurnSpeed(
        str(backend.model_path),
        token_work(backend.info),
        attention_work(ModelDims.from_gguf(backend.info), filled),
        stats.generated_tokens,
        stats.gen_tps,
        backend.threads,
        1.0 if stats.gen_cpu_share is None else stats.gen_cpu_share,
    )
    return note_turn(paths.speed_calibration, paths.turn_speeds, turn)


@dataclass
class OneOffTurn:
    """A reply outside any conversation (``Session.ask_once``): iterate it for deltas; its
    figures after, as ``ask --json`` reports them."""

    generation: Reply
    restore: RestoreReport | None = None  # how a local model's cache began (a prefix state)
    notices: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[TokenDelta]:
        yield from self.generation  # closing this closes the reply's stream

    def stats_dict(self) -> dict[str, Any]:
        return turn_stats_dict(self.generation.stats, self.restore)


@dataclass(frozen=True)
class ServerModelRow:
    """One model a configured server serves (or why the server could not be listed)."""

    server: str  # the server's name in settings.toml
    model: str | None
    context_size: int | None = None
    problem: str | None = None


def server_model_rows(servers: tuple[ServerConfig, ...]) -> list[ServerModelRow]:
    """What each configured server serves, for the Models screen (network calls: a thread)."""
    rows: list[ServerModelRow] = []
    for server in servers:
        try:
            backend = _server_backend(server)
        except LocalchatError as exc:  # one server down never hides the others, or local models
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
    from localchat.backends.remote import RemoteBackend
    from localchat.conversation.remote import RemoteConversation

    if isinstance(backend, RemoteBackend):
        return RemoteConversation.open(store, states, name, backend, system_prompt, wait_s=wait_s)
    raise TypeError(f"no conversation for a {type(backend).__name__}")


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

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes with the backend in use: a local model's tokenizer on the
        compute thread, a server's over the network (blocking: a thread)."""
        backend = self.backend
        if backend is None:
            raise UsageError("no model is loaded yet")
        if isinstance(backend, Engine):
            return run_compute(backend.count_tokens, text)
        return backend.count_tokens(text)

    def note_turn_speed(self, stats: TurnStats) -> str | None:
        """A finished turn's speed counted against the calibration (a notice if corrected)."""
        return None if self.backend is None else note_turn_speed(self.paths, self.backend, stats)

    def ask_once(
        self,
        messages: Sequence[ChatMessage],
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        tool_use: ToolUse | None = None,
    ) -> OneOffTurn:
        """A reply to ``messages`` that no conversation keeps (the CLI's one-off ``ask``), on
        the calling thread; ``tool_use``: the tools it is offered. A local model starts a long enough system prompt (or attached
        files) from its saved prefix state, saving it the first time; a server just answers."""
        backend = self.backend
        if backend is None:
            raise UsageError("no model is loaded yet")
        if not isinstance(backend, Engine):
            return OneOffTurn(backend.stream(messages, sampling, max_tokens, cancel, tool_use))
        messages = list(messages)
        builder = backend.prompt_builder(tools=list(tool_use.tools) if tool_use else None)
        prompt = builder.build(messages)
        states = self.states or StateStore(self.paths.states_dir, self.settings.state_budget_bytes)
        prefix = start_from_prefix(
            backend.cache,
            states,
            backend.state_key,
            prompt.tokens,
            prefix_spans(builder, messages, prompt, len(messages) - 1),
            self.settings.prefix_state_min_tokens,
        )
        generation = backend.generate(prompt.tokens, sampling, max_tokens, cancel, tool_use)
        return OneOffTurn(generation, RestoreReport.from_prefix(prefix))

    def connect(
        self, spec: str, model: str | None = None, context_size: int | None = None
    ) -> RemoteBackend:
        return connect(self.settings, spec, model, context_size)

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
        if quitting:
            free_backend = not isinstance(self.backend, Engine)
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
