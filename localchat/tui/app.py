"""The localchat app: the session's lifecycle (which model answers, its start-up and
switches, quitting) around the chat screen, which draws and drives a conversation.

Blocking runtime calls (finding or downloading a model, loading it) run in thread workers that
only post typed messages; every widget change happens on the app's thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.notifications import SeverityLevel
from textual.screen import Screen

from localchat.backends.base import Backend, Sampling
from localchat.backends.compute_thread import run_compute, wait_idle
from localchat.backends.servers import connect
from localchat.conversation.base import ConversationBase
from localchat.errors import LocalchatError, one_line
from localchat.gguf.names import display_name
from localchat.models.launch import LaunchOptions
from localchat.paths import app_paths
from localchat.settings import Settings, load_settings
from localchat.tui.bindings import CHAT_APP_ACTIONS, CHAT_BINDINGS, QUIT_BINDING
from localchat.tui.messages import (
    ModelChosen,
    ModelLoaded,
    ModelLoadFailed,
    ModelMissing,
    SessionOpened,
    StartupNotice,
    StartupProgress,
    StartupStep,
    StartupWarning,
)
from localchat.tui.process import exit_on_signals, freeze_long_lived
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.help import HelpScreen
from localchat.tui.screens.no_model import NoModelScreen
from localchat.tui.screens.startup import StartupScreen
from localchat.tui.screens.tools import ToolsScreen
from localchat.tui.state import AppState
from localchat.tui.widgets.chat_message import (
    AssistantMessage,
    ChatEntry,
    UserMessage,
    warm_up_markdown,
)
from localchat.tui.widgets.image_view import enable_pictures
from localchat.tui.worker_failures import ReportsWorkerFailures

if TYPE_CHECKING:  # llama.cpp and the hub client: imported in workers, after the first frame
    from localchat.session import Session
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store
    from localchat.tui.screens.models import ServerChoice

# No launch flags: the model runs as settings.toml says.
FROM_SETTINGS = LaunchOptions()
# How long quitting waits for a reply being written to stop and be committed.
QUIT_WAIT_S = 10.0


class LocalChatApp(ReportsWorkerFailures, App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "localchat"
    BINDINGS: ClassVar[list[BindingType]] = [QUIT_BINDING]

    def __init__(
        self,
        model_path: Path | None = None,
        launch: LaunchOptions = FROM_SETTINGS,
        max_tokens: int | None = None,
        sampling: Sampling | None = None,
        conversation_name: str | None = None,
        system_prompt: str | None = None,
        model_name: str | None = None,
        demo: bool = False,
        server: str | None = None,
    ) -> None:
        """``launch``: how a local model runs (the settings fill what it leaves unset);
        ``server``: chat through this OpenAI-compatible server (URL or settings name), and
        ``model_name`` is then one of its models."""
        super().__init__()
        self.server = server
        self.model_path = model_path
        self.launch = launch
        self.model_name = model_name
        self.demo = demo
        self.conversation_name = conversation_name
        # The session (the lifecycle: backend, stores, the open conversation), the settings
        # and the options the chat screen reads: one object, handed to it.
        self.state = AppState(sampling=sampling, max_tokens=max_tokens, system_prompt=system_prompt)
        self._startup_cancel = threading.Event()
        self._startup_skip = threading.Event()  # Esc during the speed calibration
        self._heap_frozen = False
        self._startup_screen: StartupScreen | None = None
        self._chat: ChatScreen | None = None

    def get_default_screen(self) -> Screen[Any]:
        self._chat = ChatScreen(self.state)
        return self._chat

    @property
    def session(self) -> Session | None:
        return self.state.session

    @property
    def settings(self) -> Settings:
        return self.state.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.state.settings = settings

    @property
    def quitting(self) -> bool:
        return self.state.quitting

    @property
    def chat(self) -> ChatScreen:
        """The chat screen (the first on the stack; dialogs open above it)."""
        assert self._chat is not None
        return self._chat

    @property
    def backend(self) -> Backend | None:
        """What answers: a model loaded here, or a server."""
        return None if self.session is None else self.session.backend

    @property
    def conversation(self) -> ConversationBase | None:
        return None if self.session is None else self.session.conversation

    @property
    def store(self) -> Store | None:
        return None if self.session is None else self.session.store

    @property
    def states(self) -> StateStore | None:
        return None if self.session is None else self.session.states

    def on_mount(self) -> None:
        self.sub_title = "starting…"

    def on_ready(self) -> None:
        """The first screen is up: now the runtime's imports and the model (in workers,
        which would otherwise hold the interpreter while that screen is being drawn)."""
        self.open_session()
        self.warm_up()

    @work(thread=True, exit_on_error=False, exclusive=True, group="model")
    def open_session(self) -> None:
        """The user's settings and stores, and the runtime behind them (llama.cpp, the hub
        client: heavy imports, made here so that the first frame does not wait for them)."""
        from localchat.session import Session

        paths = app_paths()
        settings = self.settings
        try:
            settings = load_settings(paths.settings_file)
            session = Session(paths, settings)
        except LocalchatError as exc:
            self.post_message(
                SessionOpened(Session(paths, settings, open_stores=False), settings, str(exc))
            )
            return
        self.post_message(SessionOpened(session, settings))

    def on_session_opened(self, message: SessionOpened) -> None:
        if self.quitting:  # gone before it opened: nothing is kept open
            message.session.close()
            return
        self.state.session, self.state.settings = message.session, message.settings
        if message.error is not None:
            self.notify(
                message.error, title="Conversations unavailable", severity="error", timeout=30
            )
        state = self.state
        if state.max_tokens is None:
            state.max_tokens = state.settings.max_tokens
        if state.sampling is None:
            state.sampling = Sampling(temperature=state.settings.temperature)
        if self.server is not None:
            self.connect_server(self.server, self.launch.n_ctx)
        else:
            self.choose_model()
        if self.settings.mcp:
            self.start_tools(message.session)

    @work(thread=True, exit_on_error=False, group="tools")
    def start_tools(self, session: Session) -> None:
        """The MCP servers start beside the model; one that cannot is a notice (and one
        that answers late, another)."""

        def late(line: str) -> None:
            self.notify(line, title="Tools", timeout=15)

        for problem in session.start_tools(late):
            self.notify(problem, title="Tools", severity="warning", timeout=15)

    def action_tools(self) -> None:
        """The MCP servers' tools, each on or off for the replies."""
        session = self.session
        if session is None:
            return
        statuses = session.tools.statuses

        def chosen(states: dict[str, bool] | None) -> None:
            changed = {n: on for n, on in (states or {}).items() if on == (n in session.tools.off)}
            if changed:
                self.turn_tools(session, changed)
                self.notify("The next reply reads the conversation again (the tools changed).")

        self.push_screen(ToolsScreen(statuses, set(session.tools.off)), chosen)

    @work(thread=True, exit_on_error=False, group="tools")
    def turn_tools(self, session: Session, changed: dict[str, bool]) -> None:
        for name, on in changed.items():
            session.turn_tool(name, on)

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Notices carry outside text (errors, file names, model output): never markup."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    # -- workers (thread): they only post messages -------------------------------------
    @work(thread=True, exit_on_error=False, exclusive=True, group="warm-up")
    def warm_up(self) -> None:
        warm_up_markdown()

    @work(thread=True, exit_on_error=False, exclusive=True, group="model")
    def choose_model(self) -> None:
        """Find the model to run: the one asked for, the last one used, or a first download."""
        from localchat.models.hub import DownloadCancelled, HubError  # loaded with the session
        from localchat.models.start_model import StartAsked, StartHooks, start_model

        assert self.session is not None
        self._startup_cancel.clear()  # an Esc of an earlier start does not stop this one
        self._startup_skip.clear()
        try:
            asked = StartAsked(self.model_path, self.model_name, self.demo, self._last_model())
            hooks = StartHooks(
                notice=lambda text: self.post_message(StartupNotice(text)),
                warn=lambda text: self.post_message(StartupWarning(text)),
                progress=lambda p: self.post_message(StartupProgress(p)),
                cancel=self._startup_cancel,
                steps=lambda step: self.post_message(StartupStep(step)),
                skip=self._startup_skip,
            )
            path = start_model(self.session.paths, self.settings.min_tokens_per_s, asked, hooks)
        except (HubError, DownloadCancelled) as exc:
            self.post_message(ModelMissing(str(exc)))
            return
        except LocalchatError as exc:
            self.post_message(ModelLoadFailed(str(exc)))
            return
        except Exception as exc:  # never a start screen left up with nothing behind it
            self.post_message(ModelLoadFailed(f"the start failed: {one_line(exc)}"))
            return
        self.post_message(ModelChosen(path))

    def _last_model(self) -> str | None:
        """The file the newest conversation used (a plain start reopens it)."""
        store = self.store
        recent = store.conversations() if store is not None else []
        return recent[0].model if recent else None

    @work(thread=True, exit_on_error=False, exclusive=True, group="model")
    def connect_server(self, spec: str, context_size: int | None = None) -> None:
        """Reach the server and pick its model (the listing, a count probe: network calls).
        ``context_size``: --ctx given with --server, the server's context as the user knows it."""
        assert self.session is not None
        start = time.perf_counter()
        try:
            server = self.session.settings.server(spec)
            backend = connect(server, self.model_name, context_size)
        except LocalchatError as exc:
            self.post_message(ModelLoadFailed(str(exc)))
            return
        self.post_message(ModelLoaded(backend, time.perf_counter() - start))

    @work(thread=True, exit_on_error=False, exclusive=True, group="model")
    def load_model(self, path: Path) -> None:
        from localchat.models.loader import ModelLoader  # loaded with the session

        assert self.session is not None
        start = time.perf_counter()
        try:
            engine = ModelLoader(self.session.paths).load(
                path,
                self.settings.launch(self.launch),
                warn=lambda text: self.post_message(StartupWarning(text)),
            )
        except (LocalchatError, OSError) as exc:  # a broken catalog, an unreadable file
            self.post_message(ModelLoadFailed(one_line(exc)))
            return
        self.post_message(ModelLoaded(engine, time.perf_counter() - start))

    def _shown_startup_screen(self) -> StartupScreen:
        if self._startup_screen is None:
            self._startup_screen = StartupScreen(self._startup_cancel, self._startup_skip)
            self.push_screen(self._startup_screen)
        return self._startup_screen

    def on_startup_notice(self, message: StartupNotice) -> None:
        self.sub_title = message.text
        self._shown_startup_screen().show_plan(message.text)

    def on_startup_warning(self, message: StartupWarning) -> None:
        self.notify(message.text, severity="warning", timeout=15)

    def on_startup_step(self, message: StartupStep) -> None:
        self.sub_title = message.step.line()
        self._shown_startup_screen().show(message.step)

    def on_startup_progress(self, message: StartupProgress) -> None:
        progress = message.progress
        total = max(1, progress.bytes_total)
        self.sub_title = f"downloading {progress.name}: {100 * progress.bytes_done / total:.0f}%"
        self._shown_startup_screen().show(progress)

    def _close_startup_screen(self) -> None:
        if self._startup_screen is not None:
            if self._startup_screen in self.screen_stack:
                self._startup_screen.dismiss(None)
            self._startup_screen = None

    def on_model_chosen(self, message: ModelChosen) -> None:
        self._close_startup_screen()
        self.sub_title = f"loading {display_name(message.path)}…"
        self.load_model(message.path)

    def on_model_missing(self, message: ModelMissing) -> None:
        self._close_startup_screen()
        self.sub_title = "no model"

        def chosen(choice: str | None) -> None:
            if choice == "demo":
                self.demo = True
                self.choose_model()
            elif choice:
                self.model_path = Path(choice).expanduser()
                self.choose_model()

        self.push_screen(NoModelScreen(message.reason), chosen)

    async def on_model_loaded(self, message: ModelLoaded) -> None:
        assert self.session is not None
        name = self.conversation.record.name if self.conversation else self.conversation_name
        await self.chat.close_conversation()
        old = self.session.use(message.backend)
        if old is not None:  # llama.cpp frees it on the compute thread, off the event loop
            await asyncio.to_thread(run_compute, old.close)
        if self.chat.torn_down():
            return
        panel = self.chat.panel
        view = message.backend.describe()
        self.sub_title = view.title
        panel.show_backend(view)
        self.chat.show_cache(0)
        done = "connected" if view.server else "model loaded"
        panel.show_turn_start(f"{done} in {message.load_s:.2f} s")
        if not self._heap_frozen:
            self._heap_frozen = True
            freeze_long_lived()
        await self.chat.open_conversation(name)

    def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        self._close_startup_screen()
        self.sub_title = "no model" if self.backend is None else self.sub_title
        self.notify(
            f"{message.error}\nPick another model with Ctrl+O.",
            title="Model failed to load",
            severity="error",
            timeout=30,
        )

    def action_models(self) -> None:
        from localchat.tui.screens.models import ModelsScreen, ServerChoice

        if self.chat.generating:
            return

        def switch(choice: Path | ServerChoice | None) -> None:
            if isinstance(choice, ServerChoice):
                self.server, self.model_name = choice.server, choice.model
                self.sub_title = f"connecting to {choice.server}…"
                self.connect_server(choice.server)
            elif choice is not None:
                self.server = None
                self.sub_title = f"loading {display_name(choice)}…"
                self.load_model(choice)

        loaded = getattr(self.backend, "model_path", None)  # None: a server's model
        screen = ModelsScreen(None, self.settings.min_tokens_per_s, self.settings.servers, loaded)
        self.push_screen(screen, switch)

    def action_hardware(self) -> None:
        from localchat.tui.screens.hardware import HardwareScreen

        self.push_screen(HardwareScreen(self.settings.min_tokens_per_s))

    def action_help(self) -> None:
        every = [*ChatEntry.BINDINGS, *UserMessage.BINDINGS, *AssistantMessage.BINDINGS]
        keys = [b for b in every if isinstance(b, Binding)]
        self.push_screen(HelpScreen([*CHAT_BINDINGS, QUIT_BINDING], keys))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The chat's keys that the app acts on (models, hardware, help) work from the chat
        screen only: inside a dialog its own keys win."""
        return not (action in CHAT_APP_ACTIONS and self.screen is not self._chat)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if not isinstance(screen, ChatScreen):
            return
        yield SystemCommand(
            "Copy code", "Copy the last code block of the conversation", screen.action_copy_code
        )
        yield SystemCommand(
            "Edit the last question",
            "Edit it: sent again, it starts a new branch (the old one is kept)",
            screen.edit_last_question,
        )
        for step, which in ((-1, "Previous"), (1, "Next")):
            yield SystemCommand(
                f"{which} branch",
                f"The {which.lower()} branch at the last message that has several",
                lambda step=step: screen.run_worker(screen.step_last_branch(step), group="branch"),
            )
        yield SystemCommand(
            "Tools", "The MCP servers' tools: turn each on or off", self.action_tools
        )
        for binding in CHAT_BINDINGS:
            target: object = screen
            action = binding.action
            if action.startswith("app."):
                target, action = self, action.removeprefix("app.")
            yield SystemCommand(
                binding.description, binding.tooltip, getattr(target, f"action_{action}")
            )

    def exit(self, *args: Any, **kwargs: Any) -> None:
        """Quitting stops a reply at once (the turn then commits what was written), and a
        first start's calibration or download at its next step."""
        self.state.quitting = True
        if self._chat is not None:
            self._chat.quit_turn(0)
        self._startup_cancel.set()
        self._startup_skip.set()
        super().exit(*args, **kwargs)

    def on_unmount(self) -> None:
        # Quit (Ctrl+Q, SIGTERM, a closed terminal) mid-reply: stop the model, and let the
        # turn commit the partial reply before the conversation closes (bounded wait).
        if self._chat is not None and not self._chat.quit_turn(QUIT_WAIT_S):
            self.log.warning("the reply did not stop in time; it may be incomplete")
        self.state.quitting = True
        wait_idle(QUIT_WAIT_S)  # a step of reading ahead ends before the stores close
        # A conversation still to open in a thread is not opened; one in flight is waited for.
        if self.session is not None:
            self.session.close(QUIT_WAIT_S, quitting=True)


def run_app(
    model_path: Path | None = None,
    launch: LaunchOptions = FROM_SETTINGS,
    conversation: str | None = None,
    model_name: str | None = None,
    demo: bool = False,
    server: str | None = None,
) -> int:
    app = LocalChatApp(
        model_path,
        launch,
        conversation_name=conversation,
        model_name=model_name,
        demo=demo,
        server=server,
    )
    exit_on_signals(app.exit)
    enable_pictures()  # the terminal asked what it draws, before Textual reads its input
    app.run()
    return app.return_code or 0
