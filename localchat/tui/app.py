"""The localchat app: chat with streamed replies and live KV-cache figures.

Blocking runtime calls (finding or downloading a model, loading it, generating) run in thread
workers that only post typed messages; every widget change happens on the app's thread.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.widgets import Footer, Header, Markdown, TextArea
from textual.widgets.markdown import MarkdownStream

from localchat.compute_thread import compute_waiting, run_compute, wait_idle
from localchat.conversation import (
    Conversation,
    ConversationBase,
    ConversationTurn,
    ReadAheadResult,
)
from localchat.engine import Engine, Sampling
from localchat.errors import LocalchatError, one_line
from localchat.hub import DownloadCancelled, HubError
from localchat.kvstate import StateStore
from localchat.paths import app_paths
from localchat.reasoning import split_reasoning
from localchat.session import Session
from localchat.settings import Settings, load_settings
from localchat.store import Store
from localchat.tui.messages import (
    ConversationRestored,
    ModelChosen,
    ModelLoaded,
    ModelLoadFailed,
    ModelMissing,
    ReadAhead,
    ReplyChunk,
    ReplyFailed,
    ReplyFinished,
    StartupNotice,
    StartupProgress,
)
from localchat.tui.pacing import MIN_INTERVAL_S, FramePacer
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.download import DownloadScreen
from localchat.tui.screens.hardware import HardwareScreen
from localchat.tui.screens.help import HelpScreen
from localchat.tui.screens.models import ModelsScreen, ServerChoice
from localchat.tui.screens.no_model import NoModelScreen
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.widgets.chat_message import (
    AssistantMessage,
    Notice,
    UserMessage,
    warm_up_markdown,
)
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel
from localchat.tui.worker_failures import ReportsWorkerFailures
from localchat.units import count

if TYPE_CHECKING:  # the wire to servers is imported only when one is used
    from localchat.remote import RemoteBackend

# How long quitting waits for a reply being written to stop and be committed.
QUIT_WAIT_S = 10.0
# The worker posts text at most this often; the pacer decides which chunks get drawn at once.
# The stats panel's speed and cache lines change less often still.
CHUNK_INTERVAL_S = MIN_INTERVAL_S
STATS_INTERVAL_S = 0.5
_T = TypeVar("_T")

# What a first start downloads when nothing is on disk (at the planner's quant).

# App shortcuts take priority over the message box's own keys (it would otherwise swallow
# some); Esc does not, so that it can close dialogs first.
_BINDINGS: list[Binding] = [
    Binding(
        "escape", "stop", "Stop", tooltip="Stop generating; the partial reply is kept", id="stop"
    ),
    *(
        Binding(key, action, description, tooltip=tooltip, priority=True, id=binding_id)
        for key, action, description, tooltip, binding_id in (
            ("ctrl+n", "new_chat", "New", "Start a new conversation", "new-chat"),
            (
                "ctrl+l",
                "conversations",
                "Chats",
                "List, search, resume, rename, delete, export",
                "chats",
            ),
            ("ctrl+o", "models", "Models", "Download, switch or add a model", "models"),
            ("ctrl+r", "regenerate", "Regenerate", "Answer the last message again", "regenerate"),
            (
                "ctrl+s",
                "system_prompt",
                "System",
                "Edit this conversation's system prompt",
                "system",
            ),
            ("ctrl+g", "copy_reply", "Copy", "Copy the last reply to the clipboard", "copy"),
            ("f3", "hardware", "Hardware", "This machine and what runs on it", "hardware"),
            ("f1", "help", "Help", "Every key", "help"),
        )
    ),
    Binding("ctrl+q", "quit", "Quit", tooltip="Quit (the last state is saved first)", id="quit"),
]


_CHAT_ACTIONS = frozenset(b.action for b in _BINDINGS if b.action != "quit")


class LocalChatApp(ReportsWorkerFailures, App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "localchat"
    BINDINGS: ClassVar[list[BindingType]] = list(_BINDINGS)

    def __init__(
        self,
        model_path: Path | None = None,
        n_ctx: int | None = None,
        max_tokens: int | None = None,
        sampling: Sampling | None = None,
        conversation_name: str | None = None,
        system_prompt: str | None = None,
        model_name: str | None = None,
        demo: bool = False,
        template: str | None = None,
        server: str | None = None,
    ) -> None:
        """``server``: chat through this OpenAI-compatible server (URL or settings name);
        ``model_name`` is then one of its models."""
        super().__init__()
        self.server = server
        self.model_path = model_path
        self.template = template
        self.model_name = model_name
        self.demo = demo
        self.n_ctx = n_ctx
        self.settings = Settings()
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.conversation_name = conversation_name
        self.system_prompt = system_prompt
        # The lifecycle (backend, stores, the open conversation): the app draws it.
        self.session: Session | None = None
        self._cancel = threading.Event()
        # Set while no turn runs: quitting waits on it, so a reply being written is committed.
        self._turn_idle = threading.Event()
        self._turn_idle.set()
        self._generating = False
        self._reply: AssistantMessage | None = None
        self._user_view: UserMessage | None = None
        self._stream: MarkdownStream | None = None
        self._pacer: FramePacer | None = None
        self._undrawn = ""  # reply text received but not drawn yet (the pacer held it)
        self._stats_shown_at = 0.0
        self._startup_cancel = threading.Event()
        self._download_screen: DownloadScreen | None = None
        self._startup_notice = ""  # the first download's plan, shown on its screen
        self._quitting = False
        # The message box's text and a count of its changes, read ahead by one worker at a
        # time (see read_ahead).
        self._draft = ""
        self._draft_version = 0
        self._draft_lock = threading.Lock()
        self._reading_ahead = False

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="log")
                yield PromptInput(id="input", placeholder="Message (Enter sends, Ctrl+J new line)")
            yield StatsPanel()
        yield Footer()

    @property
    def engine(self) -> Engine | RemoteBackend | None:
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
        self.query_one(PromptInput).focus()
        paths = app_paths()
        try:
            self.settings = load_settings(paths.settings_file)
            self.session = Session(paths, self.settings)
        except LocalchatError as exc:
            self.notify(str(exc), title="Conversations unavailable", severity="error", timeout=30)
            self.session = Session(paths, self.settings, open_stores=False)
        if self.max_tokens is None:
            self.max_tokens = self.settings.max_tokens
        if self.sampling is None:
            self.sampling = Sampling(temperature=self.settings.temperature)
        if self.server is not None:
            self.connect_server(self.server, self.n_ctx)
        else:
            self.choose_model()
        self.warm_up()

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
        assert self.session is not None
        try:
            path = self.session.startup_model(
                self.model_path,
                self.model_name,
                self.demo,
                notice=lambda text: self.post_message(StartupNotice(text)),
                warn=lambda text: self.call_from_thread(self.notify, text, severity="warning"),
                progress=lambda p: self.post_message(StartupProgress(p)),
                cancel=self._startup_cancel,
            )
        except (HubError, DownloadCancelled) as exc:
            self.post_message(ModelMissing(str(exc)))
            return
        except LocalchatError as exc:
            self.post_message(ModelLoadFailed(str(exc)))
            return
        self.post_message(ModelChosen(path))

    @work(thread=True, exit_on_error=False, exclusive=True, group="model")
    def connect_server(self, spec: str, context_size: int | None = None) -> None:
        """Reach the server and pick its model (the listing, a count probe: network calls).
        ``context_size``: --ctx given with --server, the server's context as the user knows it."""
        assert self.session is not None
        start = time.perf_counter()
        try:
            backend = self.session.connect(spec, self.model_name, context_size)
        except LocalchatError as exc:
            self.post_message(ModelLoadFailed(str(exc)))
            return
        self.post_message(ModelLoaded(backend, time.perf_counter() - start))

    @work(thread=True, exit_on_error=False, exclusive=True, group="model")
    def load_model(self, path: Path) -> None:
        assert self.session is not None
        start = time.perf_counter()
        try:
            engine = self.session.load_model(path, self.n_ctx, self.template)
        except (LocalchatError, OSError) as exc:  # a broken catalog, an unreadable file
            self.post_message(ModelLoadFailed(one_line(exc)))
            return
        self.post_message(ModelLoaded(engine, time.perf_counter() - start))

    @work(thread=True, exit_on_error=False, exclusive=True, group="generate")
    def generate(self, conversation: Conversation, text: str, entered_at: float) -> None:
        run_compute(self._run_turn, conversation, text, entered_at)

    def _run_turn(self, conversation: Conversation, text: str, entered_at: float) -> None:
        """One turn, on the compute thread: posts the reply as it comes, in chunks."""
        try:
            self._stream_turn(conversation, text, entered_at)
        finally:
            self._turn_idle.set()

    def _stream_turn(self, conversation: Conversation, text: str, entered_at: float) -> None:
        try:
            turn = conversation.send(
                text, self.sampling, self.max_tokens or 512, self._cancel, entered_at=entered_at
            )
        except LocalchatError as exc:
            self.post_message(ReplyFailed(str(exc), text))
            return
        except Exception as exc:  # the app stays up whatever the runtime raises
            self.post_message(ReplyFailed(f"unexpected error: {exc}", text))
            return
        pending = thinking = ""
        last_post = time.perf_counter()
        try:
            for delta in turn:
                if delta.reasoning:
                    thinking += delta.text
                else:
                    pending += delta.text
                now = time.perf_counter()
                if now - last_post >= CHUNK_INTERVAL_S:
                    self._post_chunk(conversation, turn, pending, thinking)
                    pending = thinking = ""
                    last_post = now
        except Exception as exc:
            self.notify(f"generation failed: {exc}", severity="error", timeout=15)
        if pending or thinking:
            self._post_chunk(conversation, turn, pending, thinking)
        self.post_message(
            ReplyFinished(replace(turn.stats), _context_tokens(conversation, turn), turn)
        )

    def _post_chunk(
        self, conversation: ConversationBase, turn: ConversationTurn, text: str, thinking: str
    ) -> None:
        kv_tokens = _context_tokens(conversation, turn)
        stats = replace(turn.stats)
        self.post_message(ReplyChunk(text, stats, kv_tokens, thinking, turn.sent_ttft_s))

    @on(TextArea.Changed, "#input")
    def _draft_changed(self, event: TextArea.Changed) -> None:
        """The message being typed is read ahead in the background (setting type_ahead)."""
        self._schedule_read_ahead(event.text_area.text)

    def _schedule_read_ahead(self, text: str) -> None:
        conversation = self.conversation
        if not self.settings.type_ahead or not isinstance(conversation, Conversation):
            return
        with self._draft_lock:
            self._draft = text
            self._draft_version += 1
            if self._reading_ahead:
                return  # the running worker picks the new text up
            self._reading_ahead = True
        self.read_ahead(conversation)

    def _read_ahead_box(self) -> None:
        """Read what the box holds ahead (after a turn, on opening a conversation): the
        conversation it was read for may have changed under it."""
        if self._torn_down():
            return
        text = self.query_one(PromptInput).text
        if text.strip():
            self._schedule_read_ahead(text)

    @work(thread=True, exit_on_error=False, group="read-ahead")
    def read_ahead(self, conversation: Conversation) -> None:
        """Read the newest text of the message box ahead until it is read, on the compute
        thread, giving way at once to anything else asked of it (the turn Enter starts, a
        model switch, a restore); one such worker runs at a time."""
        done = -1
        shown = 0
        try:
            while True:
                with self._draft_lock:
                    draft, version = self._draft, self._draft_version
                    if version == done or self._quitting or conversation is not self.conversation:
                        self._reading_ahead = False
                        return
                result, kv_tokens = run_compute(self._read_ahead_now, conversation, draft, version)
                if result.finished:  # else it gave way: again, after what waited
                    done = version
                if result.tokens != shown:
                    shown = result.tokens
                    self.post_message(ReadAhead(conversation.record.id, result.tokens, kv_tokens))
        except BaseException:
            with self._draft_lock:
                self._reading_ahead = False
            raise

    def _read_ahead_now(
        self, conversation: Conversation, draft: str, version: int
    ) -> tuple[ReadAheadResult, int]:
        """On the compute thread: what was read ahead, and what the cache holds in all."""
        if conversation.closed or self._quitting:  # its model and stores may be gone too
            return ReadAheadResult(0), 0
        if version != self._draft_version:  # typed on since: the newer text is read instead
            return ReadAheadResult(0, finished=False), 0
        try:
            result = conversation.read_ahead(draft, self.max_tokens or 512, self._give_way)
        except Exception as exc:  # reading ahead is a bonus: the turn will say what is wrong
            self.log.warning(f"reading ahead failed: {exc}")
            return ReadAheadResult(0), 0
        return result, len(conversation.engine.cached_tokens)

    def _give_way(self) -> bool:
        return self._quitting or compute_waiting()

    def on_read_ahead(self, message: ReadAhead) -> None:
        conversation = self.conversation
        current = conversation is not None and conversation.record.id == message.conversation_id
        if self._generating or self._torn_down() or not message.tokens or not current:
            return
        self.query_one(StatsPanel).show_turn_start(
            f"read {count(message.tokens, 'token')} ahead as you type"
        )
        self._show_cache(message.kv_tokens)

    # -- model lifecycle (app thread) ----------------------------------------------------
    def on_startup_notice(self, message: StartupNotice) -> None:
        self.sub_title = message.text
        self._startup_notice = message.text

    def on_startup_progress(self, message: StartupProgress) -> None:
        progress = message.progress
        total = max(1, progress.bytes_total)
        self.sub_title = f"downloading {progress.name}: {100 * progress.bytes_done / total:.0f}%"
        if self._download_screen is None:
            self._download_screen = DownloadScreen(
                progress.name, self._startup_cancel, self._startup_notice
            )
            self.push_screen(self._download_screen)
        if self._download_screen.is_mounted:
            self._download_screen.show(progress)

    def _close_download_screen(self) -> None:
        if self._download_screen is not None:
            if self._download_screen in self.screen_stack:
                self._download_screen.dismiss(None)
            self._download_screen = None

    def on_model_chosen(self, message: ModelChosen) -> None:
        self._close_download_screen()
        self.sub_title = f"loading {message.path.name}…"
        self.load_model(message.path)

    def on_model_missing(self, message: ModelMissing) -> None:
        self._close_download_screen()
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
        await self._close_conversation()
        old = self.session.use(message.engine)
        if old is not None:  # llama.cpp frees it on the compute thread, off the event loop
            await asyncio.to_thread(run_compute, old.close)
        if self._torn_down():
            return
        panel = self.query_one(StatsPanel)
        if not isinstance(message.engine, Engine):  # a server
            backend = message.engine
            self.sub_title = f"{backend.model} · {backend.server}"
            panel.show_server(backend.model, backend.server, backend.context_size)
            self._show_cache(0)
            panel.show_turn_start(f"connected in {message.load_s:.2f} s")
            await self._open_conversation(name)
            return
        info = message.engine.info
        self.sub_title = f"{info.name} · {info.file_type}"
        panel.show_model(
            info.name,
            info.file_type,
            message.engine.options.kv_type,
            message.engine.n_ctx,
            message.engine.options.n_gpu_layers,
            message.engine.template.name,
            message.engine.buffers_summary(),
        )
        self._show_cache(0)
        panel.show_turn_start(f"model loaded in {message.load_s:.2f} s")
        await self._open_conversation(name)

    def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        self._close_download_screen()
        self.sub_title = "no model" if self.engine is None else self.sub_title
        self.notify(
            f"{message.error}\nPick another model with Ctrl+O.",
            title="Model failed to load",
            severity="error",
            timeout=30,
        )

    async def _open_conversation(self, name: str | None) -> None:
        """Open ``name`` (default: the most recent conversation, or a new one)."""
        session = self.session
        if session is None:
            return
        # Opening reads the database and the model file's fingerprint: off the event loop.
        try:
            conversation = await asyncio.to_thread(
                session.open_conversation, name, self.system_prompt
            )
        except LocalchatError as exc:
            self.notify(str(exc), severity="warning", timeout=15)
            conversation = await asyncio.to_thread(
                session.open_conversation, session.new_conversation_name()
            )
        if conversation is None:  # quitting, or nothing to open it on
            return
        if self._torn_down():  # the app went away while it opened
            await asyncio.to_thread(session.close_conversation)
            return
        if isinstance(conversation, Conversation):
            conversation.saver.on_error = lambda error: self.notify(error, severity="warning")
            if self.settings.restore_on_open:
                self.restore_on_open(conversation)
        self.title = f"localchat — {conversation.record.title}"
        await self._show_transcript()
        self._read_ahead_box()

    @work(thread=True, exit_on_error=False, group="restore")
    def restore_on_open(self, conversation: Conversation) -> None:
        """Its saved cache into memory now, on the compute thread (a turn sent meanwhile waits
        there for it), so the first turn after opening starts warm."""
        report = run_compute(conversation.restore_now)
        if report.restored:  # the cache now holds exactly the state's tokens
            self.post_message(ConversationRestored(report.tokens, report.seconds))

    def on_conversation_restored(self, message: ConversationRestored) -> None:
        if self._generating or self._torn_down():
            return  # the turn's own figures are the news now, or the app is going away
        self.query_one(StatsPanel).show_turn_start(
            f"restored {count(message.tokens, 'token')} from saved cache in"
            f" {message.seconds:.2f} s: ready"
        )
        self._show_cache(message.tokens)

    def _torn_down(self) -> bool:
        """Whether the app began to quit (its screens may be gone) while a thread worked."""
        if self._quitting or not self.is_running:
            return True
        stack = self.screen_stack
        # The chat lives on the first screen (dialogs open above it): gone, it is torn down.
        return not stack or not stack[0].is_mounted or not stack[0].query("#log")

    async def _close_conversation(self) -> None:
        """Close the open conversation; its last state save is waited for off the event loop."""
        if self.session is not None and self.session.conversation is not None:
            await asyncio.to_thread(self.session.close_conversation)  # saves finish

    async def _show_transcript(self) -> None:
        if self._torn_down():
            return
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        if self.conversation is None:
            return
        for exchange in self.conversation.exchanges:
            if exchange.record.role == "user":
                await log.mount(UserMessage(exchange.record.content))
            elif exchange.record.role == "assistant":
                thought, answer = split_reasoning(exchange.record.content)
                await log.mount(AssistantMessage(answer, thought))
        log.scroll_end(animate=False)

    # -- a turn ---------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def send(self, message: PromptInput.Submitted) -> None:
        if self.conversation is None:
            self.notify("No model is loaded yet; your message is kept.", severity="warning")
            return
        if self._generating:
            self.notify("Still answering; press Esc to stop first.", severity="warning")
            return
        entered_at = time.perf_counter()
        self.query_one(PromptInput).clear()
        await self._start_turn(message.text, entered_at)

    async def _start_turn(self, text: str, entered_at: float | None = None) -> None:
        """``entered_at``: when the user sent it (the first-token figure counts from there)."""
        entered_at = time.perf_counter() if entered_at is None else entered_at
        assert self.conversation is not None
        log = self.query_one("#log", VerticalScroll)
        self._reply = AssistantMessage()
        self._user_view = UserMessage(text)
        await log.mount_all([self._user_view, self._reply])
        log.anchor()
        self._stream = Markdown.get_stream(self._reply.markdown)
        self._undrawn = ""
        # A steady cursor while the model answers: each blink is a repaint taken from generation.
        self.query_one(PromptInput).cursor_blink = False
        self._cancel.clear()
        self._turn_idle.clear()
        self._generating = True
        # The message is drawn first, then the model starts: that frame does not compete
        # with generation for the cores.
        self.call_after_refresh(self._begin_generation, self.conversation, text, entered_at)

    def _begin_generation(self, conversation: Conversation, text: str, entered_at: float) -> None:
        # A server's reply costs this machine no CPU: the app's share is of one thread.
        threads = conversation.engine.threads if isinstance(conversation, Conversation) else 1
        self._pacer = FramePacer(threads)
        self.generate(conversation, text, entered_at)

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        if self._reply is None:
            return
        if message.reasoning:
            self._reply.append_reasoning(message.reasoning)
        self._undrawn += self._reply.append(message.text)
        if self._pacer is not None and self._pacer.frame_due():
            await self._draw_reply()
            now = time.perf_counter()
            if now - self._stats_shown_at >= STATS_INTERVAL_S:
                self._stats_shown_at = now
                self.query_one(StatsPanel).show_speed(message.stats, message.ttft_s)
                self._show_cache(message.kv_tokens)

    async def _draw_reply(self) -> None:
        """Hand the text the pacer held back to the Markdown stream (one frame)."""
        if self._stream is not None and self._undrawn:
            await self._stream.write(self._undrawn)
        self._undrawn = ""

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        await self._draw_reply()
        await self._end_stream()
        if self._reply is not None and self._reply.raw.strip():
            self._reply.collapse_reasoning()  # the answer is what is read now
        stats = message.stats
        panel = self.query_one(StatsPanel)
        panel.show_speed(stats, message.turn.sent_ttft_s, final=True)
        panel.show_turn_start(describe_turn_start(message.turn))
        self._show_cache(message.kv_tokens, stats.server_kv_usage)
        log = self.query_one("#log", VerticalScroll)
        for notice in message.turn.notices:
            await log.mount(Notice(notice))
        if stats.stop_reason == "cancelled":
            await log.mount(Notice("stopped — the partial reply is kept"))
        self._generating = False
        self._read_ahead_box()  # typed while the reply was written

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        await self._end_stream()
        for view in (self._user_view, self._reply):
            if view is not None:
                await view.remove()
        prompt = self.query_one(PromptInput)
        if not prompt.text.strip():
            prompt.text = message.user_text
        self.notify(message.error, title="Could not send", severity="error", timeout=15)
        self._generating = False

    # -- actions ------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self._generating:
            self._cancel.set()

    async def action_new_chat(self) -> None:
        if self._generating or self.engine is None:
            return
        await self._close_conversation()
        assert self.session is not None
        await self._open_conversation(self.session.new_conversation_name())
        self.query_one(StatsPanel).show_turn_start("new conversation")

    async def action_regenerate(self) -> None:
        if self._generating or self.conversation is None:
            return
        text = self.conversation.take_back_last_exchange()
        if text is None:
            self.notify("Nothing to regenerate yet.")
            return
        await self._show_transcript()
        await self._start_turn(text)

    def action_system_prompt(self) -> None:
        conversation = self.conversation
        if conversation is None or self._generating:
            return

        def save(text: str | None) -> None:
            if text is not None and self.conversation is conversation:
                conversation.set_system_prompt(text)
                self.notify("System prompt saved; the next reply re-reads the conversation.")

        current = conversation.record.system_prompt or ""
        self.push_screen(TextPromptScreen("System prompt for this conversation", current), save)

    def action_copy_reply(self) -> None:
        replies = list(self.query(AssistantMessage))
        if not replies:
            self.notify("No reply to copy yet.")
            return
        self.copy_to_clipboard(replies[-1].raw)
        self.notify("Copied the last reply.")

    def action_conversations(self) -> None:
        if self.store is None or self.states is None or self._generating:
            return
        current = self.conversation.record.name if self.conversation else None

        async def open_chosen(name: str | None) -> None:
            if name and self.engine is not None and name != current:
                await self._close_conversation()
                await self._open_conversation(name)

        self.push_screen(ConversationsScreen(self.store, self.states, current), open_chosen)

    def action_models(self) -> None:
        if self._generating:
            return

        def switch(choice: Path | ServerChoice | None) -> None:
            if isinstance(choice, ServerChoice):
                self.server, self.model_name = choice.server, choice.model
                self.sub_title = f"connecting to {choice.server}…"
                self.connect_server(choice.server)
            elif choice is not None:
                self.server = None
                self.sub_title = f"loading {choice.name}…"
                self.load_model(choice)

        screen = ModelsScreen(min_tps=self.settings.min_tokens_per_s, servers=self.settings.servers)
        self.push_screen(screen, switch)

    def action_hardware(self) -> None:
        self.push_screen(HardwareScreen(self.settings.min_tokens_per_s))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(_BINDINGS))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat shortcuts act on the chat screen only: inside a dialog its own keys win."""
        return not (action in _CHAT_ACTIONS and len(self.screen_stack) > 1)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for binding in _BINDINGS:
            if binding.action not in ("quit",):
                yield SystemCommand(
                    binding.description, binding.tooltip, getattr(self, f"action_{binding.action}")
                )

    # -- helpers ------------------------------------------------------------------------
    async def _end_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self._pacer = None
        self._undrawn = ""
        self.query_one(PromptInput).cursor_blink = True

    def _show_cache(self, tokens: int, server_usage: float | None = None) -> None:
        if self.engine is None:
            return
        engine = self.engine
        if not isinstance(engine, Engine):  # a server's cache is the server's
            self.query_one(StatsPanel).show_server_cache(
                server_usage, tokens, engine.context_size, engine.counts_exactly
            )
            return
        self.query_one(StatsPanel).show_cache(
            engine.kv_bytes_for(tokens), engine.kv_bytes_allocated, tokens, engine.n_ctx
        )

    def exit(self, *args: Any, **kwargs: Any) -> None:
        """Quitting stops a reply at once (the turn then commits what was written)."""
        self._cancel.set()
        self._quitting = True
        super().exit(*args, **kwargs)

    def on_unmount(self) -> None:
        # Quit (Ctrl+Q, SIGTERM, a closed terminal) mid-reply: stop the model, and let the
        # turn commit the partial reply before the conversation closes (bounded wait).
        self._cancel.set()
        if not self._turn_idle.wait(QUIT_WAIT_S):
            self.log.warning("the reply did not stop in time; it may be incomplete")
        self._quitting = True
        wait_idle(QUIT_WAIT_S)  # a step of reading ahead ends before the stores close
        # A conversation still to open in a thread is not opened; one in flight is waited for.
        if self.session is not None:
            # A server's client is closed; a local model goes with the process.
            self.session.close(QUIT_WAIT_S, free_backend=not isinstance(self.engine, Engine))


def _context_tokens(conversation: ConversationBase, turn: ConversationTurn) -> int:
    """Tokens the context holds now: the local cache's, or the server's prompt and reply."""
    if isinstance(conversation, Conversation):
        return len(conversation.engine.cached_tokens)
    return turn.stats.prompt_tokens + turn.stats.generated_tokens


def describe_turn_start(turn: ConversationTurn) -> str:
    """How the turn began: restored from disk, reused from memory, or evaluated."""
    stats = turn.stats
    restore = turn.restore
    if stats.kv_bytes_used is None:  # a server: it reads the prompt, reusing its own cache
        about = "" if stats.counted == "server" else "≈"
        return (
            f"sent {about}{count(stats.prompt_tokens, 'token')}; the server answered in"
            f" {stats.ttft_s:.2f} s"
        )
    evaluated = f"evaluated {count(stats.prompt_tokens_evaluated, 'token')} in {stats.ttft_s:.2f} s"
    if restore.read_ahead:
        ahead = count(restore.read_ahead, "token")
        evaluated = f"read {ahead} ahead as you typed; after Enter {evaluated}"
    if turn.prompt.discarded:
        # The template rewrote part of the history (see the stats' reason).
        evaluated += f"\n({count(turn.prompt.discarded, 'history token')} re-read: template)"
    if restore.restored:
        restored = count(restore.tokens, "token")
        return f"restored {restored} from saved cache in {restore.seconds:.2f} s\n{evaluated}"
    if restore.replayed:
        replayed = count(restore.replayed, "token")
        return f"re-evaluated {replayed} in {restore.seconds:.2f} s\n{evaluated}"
    reused = stats.prompt_tokens - stats.prompt_tokens_evaluated - restore.read_ahead
    return evaluated + (f"\nreused {reused:,} from the cache" if reused > 0 else "")


def _exit_on_signals(app: LocalChatApp) -> None:
    """SIGTERM and SIGHUP (the terminal closed) quit as Ctrl+Q does: the reply is kept."""
    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is not None:
            signal.signal(number, lambda _signum, _frame: app.exit())


def run_app(
    model_path: Path | None = None,
    n_ctx: int | None = None,
    conversation: str | None = None,
    model_name: str | None = None,
    demo: bool = False,
    template: str | None = None,
    server: str | None = None,
) -> int:
    app = LocalChatApp(
        model_path,
        n_ctx=n_ctx,
        conversation_name=conversation,
        model_name=model_name,
        demo=demo,
        template=template,
        server=server,
    )
    _exit_on_signals(app)
    app.run()
    return app.return_code or 0
