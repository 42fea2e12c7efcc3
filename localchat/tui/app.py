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

from localchat.backends.base import Backend, Sampling
from localchat.backends.compute_thread import compute_waiting, run_compute, wait_idle
from localchat.chat.attachments import Attachment, check_fits, read_attachment, with_attachments
from localchat.chat.reasoning import split_reasoning
from localchat.conversation.local import (
    ConversationBase,
    ConversationTurn,
    ReadAheadResult,
    fork_conversation,
)
from localchat.errors import LocalchatError, one_line
from localchat.models.hub import DownloadCancelled, HubError
from localchat.paths import app_paths
from localchat.session import Session
from localchat.settings import Settings, load_settings
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.messages import (
    AttachmentReady,
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
    StartupStep,
    StartupWarning,
)
from localchat.tui.pacing import MIN_INTERVAL_S, FramePacer
from localchat.tui.screens.conversations import ConversationsScreen
from localchat.tui.screens.hardware import HardwareScreen
from localchat.tui.screens.help import HelpScreen
from localchat.tui.screens.models import ModelsScreen, ServerChoice
from localchat.tui.screens.no_model import NoModelScreen
from localchat.tui.screens.startup import StartupScreen
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.widgets.chat_message import (
    AssistantMessage,
    ChatEntry,
    Notice,
    UserMessage,
    code_blocks,
    warm_up_markdown,
)
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel
from localchat.tui.worker_failures import ReportsWorkerFailures
from localchat.units import count

if TYPE_CHECKING:  # the wire to servers is imported only when one is used
    pass

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
    # Not in the footer (it is full): in Help and the command palette.
    Binding(
        "ctrl+t",
        "attach",
        "Attach",
        tooltip="Attach a text file (code, Markdown, logs) to your next message",
        show=False,
        priority=True,
        id="attach",
    ),
    Binding(
        "alt+up",
        "select_message",
        "Messages",
        tooltip="Select the last message (then ↑↓): edit, branches, pin, copy",
        show=False,
        priority=True,
        id="select-message",
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
        self._startup_skip = threading.Event()  # Esc during the speed calibration
        self._startup_screen: StartupScreen | None = None
        self._quitting = False
        # The message box's text and a count of its changes, read ahead by one worker at a
        # time (see read_ahead).
        self._draft = ""
        self._draft_version = 0
        self._draft_lock = threading.Lock()
        self._reading_ahead = False
        # The message being edited (its index in the branch in view): Enter sends the box's
        # text in its place, as a new branch.
        self._editing: int | None = None
        self._box_before_edit = ""
        # Files that go with the next message, and what the last one sent had (a failed
        # send gives both back).
        self._attachments: list[Attachment] = []
        self._attachment_tokens: list[int] = []  # what each costs, counted when it came
        self._sent: tuple[str, list[Attachment], list[int]] = ("", [], [])

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="log")
                yield PromptInput(id="input", placeholder="Message (Enter sends, Ctrl+J new line)")
            yield StatsPanel()
        yield Footer()

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
        self._startup_cancel.clear()  # an Esc of an earlier start does not stop this one
        self._startup_skip.clear()
        try:
            path = self.session.startup_model(
                self.model_path,
                self.model_name,
                self.demo,
                notice=lambda text: self.post_message(StartupNotice(text)),
                warn=lambda text: self.post_message(StartupWarning(text)),
                progress=lambda p: self.post_message(StartupProgress(p)),
                cancel=self._startup_cancel,
                steps=lambda step: self.post_message(StartupStep(step)),
                skip=self._startup_skip,
            )
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
    def generate(self, conversation: ConversationBase, text: str, entered_at: float) -> None:
        run_compute(self._run_turn, conversation, text, entered_at)

    def _run_turn(self, conversation: ConversationBase, text: str, entered_at: float) -> None:
        """One turn, on the compute thread: posts the reply as it comes, in chunks."""
        try:
            self._stream_turn(conversation, text, entered_at)
        finally:
            self._turn_idle.set()

    def _stream_turn(self, conversation: ConversationBase, text: str, entered_at: float) -> None:
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
            ReplyFinished(replace(turn.stats), conversation.context_tokens(turn), turn)
        )
        if self.session is not None:  # real turns correct the speed calibration
            corrected = self.session.note_turn_speed(turn.stats)
            if corrected:
                self.notify(corrected, title="Speed figures", timeout=10)

    def _post_chunk(
        self, conversation: ConversationBase, turn: ConversationTurn, text: str, thinking: str
    ) -> None:
        kv_tokens = conversation.context_tokens(turn)
        stats = replace(turn.stats)
        self.post_message(ReplyChunk(text, stats, kv_tokens, thinking, turn.sent_ttft_s))

    @on(TextArea.Changed, "#input")
    def _draft_changed(self, event: TextArea.Changed) -> None:
        """The message being typed is read ahead in the background (setting type_ahead)."""
        self._schedule_read_ahead(event.text_area.text)

    def _schedule_read_ahead(self, text: str) -> None:
        conversation = self.conversation
        if not self.settings.type_ahead or conversation is None or not conversation.reads_ahead:
            return
        if self._editing is not None:  # it replaces an earlier message: read when sent
            return
        text = with_attachments(text, self._attachments)
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
        if text.strip() or self._attachments:
            self._schedule_read_ahead(text)

    @work(thread=True, exit_on_error=False, group="read-ahead")
    def read_ahead(self, conversation: ConversationBase) -> None:
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
        self, conversation: ConversationBase, draft: str, version: int
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
        return result, conversation.context_tokens()

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
        self.sub_title = f"loading {message.path.name}…"
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
        await self._close_conversation()
        old = self.session.use(message.backend)
        if old is not None:  # llama.cpp frees it on the compute thread, off the event loop
            await asyncio.to_thread(run_compute, old.close)
        if self._torn_down():
            return
        panel = self.query_one(StatsPanel)
        view = message.backend.describe()
        self.sub_title = view.title
        panel.show_backend(view)
        self._show_cache(0)
        done = "connected" if view.server else "model loaded"
        panel.show_turn_start(f"{done} in {message.load_s:.2f} s")
        await self._open_conversation(name)

    def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        self._close_startup_screen()
        self.sub_title = "no model" if self.backend is None else self.sub_title
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
        self._end_edit()  # an edit belongs to the conversation it began in
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
        conversation.on_save_error(lambda error: self.notify(error, severity="warning"))
        if self.settings.restore_on_open:
            self.restore_on_open(conversation)
        self.title = f"localchat — {conversation.record.title}"
        await self._show_transcript()
        if conversation.hidden_branches():
            await self.query_one("#log", VerticalScroll).mount(
                Notice(
                    "Nothing is written under this system prompt yet; the conversation's other"
                    " branches are kept (the palette's Previous branch brings the last one back)."
                )
            )
        self._read_ahead_box()

    @work(thread=True, exit_on_error=False, group="restore")
    def restore_on_open(self, conversation: ConversationBase) -> None:
        """Its saved cache into memory now, on the compute thread (a turn sent meanwhile waits
        there for it), so the first turn after opening starts warm."""
        report = run_compute(conversation.restore_now)
        if report is not None and report.restored:  # the cache holds exactly the state's
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
        conversation = self.conversation
        entries: list[ChatEntry] = []
        for index, exchange in enumerate(conversation.exchanges):
            record = exchange.record
            entry: ChatEntry
            if record.role == "user":
                entry = UserMessage(record.content, record.id, conversation.branches_at(index))
            elif record.role == "assistant":
                thought, answer = split_reasoning(record.content)
                entry = AssistantMessage(answer, thought, record.id)
            else:
                continue
            entry.show_window(record.pinned, conversation.sees(index))
            entries.append(entry)
        await log.mount_all(entries)
        log.scroll_end(animate=False)

    def _show_window(self) -> None:
        """Mark what the model still sees (the window moved, a pin changed)."""
        conversation = self.conversation
        if conversation is None or self._torn_down():
            return
        place = {e.record.id: i for i, e in enumerate(conversation.exchanges)}
        for entry in self.query(ChatEntry):
            index = place.get(entry.message_id) if entry.message_id is not None else None
            if index is not None:
                pinned = conversation.exchanges[index].record.pinned
                entry.show_window(pinned, conversation.sees(index))

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
        self._sent = (message.text, self._attachments, self._attachment_tokens)
        text = with_attachments(message.text, self._attachments)
        self._attachments, self._attachment_tokens = [], []
        self.query_one(PromptInput).clear()
        if self._editing is not None:  # in place of an earlier message: a new branch
            if self._editing >= len(self.conversation.exchanges):
                self._editing = None
                self.notify("That message is no longer in view; your text is kept.")
                return
            self.conversation.branch_before(self._editing)
            self._editing = None
            await self._show_transcript()
        await self._start_turn(text, entered_at)

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

    def _begin_generation(
        self, conversation: ConversationBase, text: str, entered_at: float
    ) -> None:
        # The app's drawing budget is a share of what generating costs this machine.
        self._pacer = FramePacer(self.backend.threads if self.backend is not None else 1)
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
        conversation = self.conversation
        if self._user_view is not None and conversation is not None:  # stored: keys act on it
            self._user_view.message_id = message.turn.user.record.id
            index = self._index_of(message.turn.user.record.id)
            if index is not None:  # a regenerate or an edit: its branches
                self._user_view.show_branch(conversation.branches_at(index))
        if self._reply is not None and message.turn.reply is not None:
            self._reply.message_id = message.turn.reply.record.id
        if message.turn.window.dropped_messages:
            self._show_window()
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
        typed, attachments, tokens = self._sent
        if attachments and message.user_text == with_attachments(typed, attachments):
            # The files wait for the next try, apart from the words in the box.
            self._attachments, self._attachment_tokens = attachments, tokens
            restored_text = typed
        else:
            restored_text = message.user_text
        if not prompt.text.strip():
            prompt.text = restored_text
        self.notify(message.error, title="Could not send", severity="error", timeout=15)
        self._generating = False

    # -- branches -----------------------------------------------------------------------
    def _index_of(self, message_id: int) -> int | None:
        conversation = self.conversation
        if conversation is None:
            return None
        ids = [e.record.id for e in conversation.exchanges]
        return ids.index(message_id) if message_id in ids else None

    def on_chat_entry_edit(self, message: ChatEntry.Edit) -> None:
        index = self._index_of(message.message_id)
        if index is None or self._generating or self.conversation is None:
            return
        box = self.query_one(PromptInput)
        if self._editing is None:  # what the box held comes back if the edit is cancelled
            self._box_before_edit = box.text
        self._editing = index
        box.text = self.conversation.exchanges[index].record.content
        box.move_cursor(box.document.end)
        box.focus()
        self.notify(
            f"Editing message {index + 1}: Enter sends it as a new branch (the old one is kept);"
            " Esc cancels."
        )

    async def on_chat_entry_switch_branch(self, message: ChatEntry.SwitchBranch) -> None:
        index = self._index_of(message.message_id)
        conversation = self.conversation
        if index is None or self._generating or conversation is None:
            return
        if not conversation.switch_branch(index, message.step):
            self.notify("No other branch that way.")
            return
        self._editing = None
        await self._show_transcript()
        entries = [e for e in self.query(UserMessage) if e.message_id is not None]
        target = conversation.exchanges[index].record.id
        for entry in entries:
            if entry.message_id == target:
                entry.focus()
                entry.scroll_visible(animate=False)
        which, count = conversation.branches_at(index)
        self.query_one(StatsPanel).show_turn_start(
            f"branch {which} of {count} at message {index + 1}"
        )

    def on_chat_entry_pin(self, message: ChatEntry.Pin) -> None:
        index = self._index_of(message.message_id)
        conversation = self.conversation
        if index is None or self._generating or conversation is None:
            return
        pinned = not conversation.exchanges[index].record.pinned
        conversation.pin(index, pinned)
        self._show_window()
        self.notify(
            f"Message {index + 1} pinned: it stays in the context window."
            if pinned
            else f"Message {index + 1} unpinned: it may leave the context window."
        )

    async def on_chat_entry_fork(self, message: ChatEntry.Fork) -> None:
        """``localchat branch`` in the app: the messages up to the selected one (a question:
        up to before it, and its text in the box to ask again) in a new conversation, whose
        first turn restores them from this one's saved cache."""
        index = self._index_of(message.message_id)
        conversation, session = self.conversation, self.session
        if index is None or self._generating or conversation is None or session is None:
            return
        record = conversation.exchanges[index].record
        at = index + 1 if record.role == "assistant" else index
        assert session.store is not None and session.states is not None
        source = conversation.record.name
        await asyncio.to_thread(conversation.wait_saved)  # its last state is the source
        try:  # the saved state is copied: off the event loop
            fork, _caches = await asyncio.to_thread(
                fork_conversation, session.store, session.states, source, at
            )
        except LocalchatError as exc:
            self.notify(str(exc), title="Could not fork", severity="error", timeout=15)
            return
        await self._close_conversation()
        await self._open_conversation(fork.name)
        box = self.query_one(PromptInput)
        if record.role == "user":
            box.text = record.content
        box.focus()
        self.query_one(StatsPanel).show_turn_start(f"forked from {source} at message {at}")
        self.notify(f"Forked {source!r} at message {at} into {fork.name!r}.")

    def _edit_last_question(self) -> None:
        conversation = self.conversation
        if conversation is None:
            return
        questions = [e.record.id for e in conversation.exchanges if e.record.role == "user"]
        if questions:
            self.on_chat_entry_edit(ChatEntry.Edit(questions[-1]))

    def _step_last_branch(self, step: int) -> None:
        conversation = self.conversation
        if conversation is None:
            return
        if conversation.hidden_branches():
            conversation.show_latest_branch()
            self.run_worker(self._show_transcript(), group="transcript")
            return
        forks = [
            e.record.id
            for i, e in enumerate(conversation.exchanges)
            if e.record.role == "user" and conversation.branches_at(i)[1] > 1
        ]
        if not forks:
            self.notify("This conversation has no other branches yet.")
            return
        self.post_message(ChatEntry.SwitchBranch(forks[-1], step))

    def action_select_message(self) -> None:
        """Select the last message (its keys: edit, branches, copy)."""
        entries = list(self.query(ChatEntry))
        if entries:
            entries[-1].focus()
            entries[-1].scroll_visible(animate=False)

    # -- actions ------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self._generating:
            self._cancel.set()
        elif self._editing is not None:
            self._end_edit()
            self.notify("Edit cancelled; the conversation is as it was.")
        elif self._attachments:
            names = ", ".join(a.name for a in self._attachments)
            self._attachments, self._attachment_tokens = [], []
            self.query_one(StatsPanel).show_turn_start("no files attached")
            self.notify(f"Removed the attached {names}; the message box is as it was.")

    def _end_edit(self) -> None:
        """Stop editing: the box gets back what it held before the edit began."""
        if self._editing is not None:
            self._editing = None
            box = self.query_one(PromptInput)
            box.text = self._box_before_edit
            box.move_cursor(box.document.end)

    def action_attach(self) -> None:
        if self.backend is None:
            self.notify("No model is loaded yet.", severity="warning")
            return

        def chosen(path: str | None) -> None:
            if path and self.session is not None:
                conversation = self.conversation
                system = conversation.record.system_prompt if conversation else None
                self.load_attachment(self.session, Path(path).expanduser(), system)

        hint = "its path · Ctrl+S attaches · Esc cancels"
        self.push_screen(TextPromptScreen("Attach a text file", "", hint), chosen)

    @work(thread=True, exit_on_error=False, group="attach")
    def load_attachment(self, session: Session, path: Path, system: str | None) -> None:
        """Read the file and count its tokens (the model's tokenizer, or the server's) and
        the system prompt's (``system``: what the conversation had when it was chosen)."""
        try:
            attachment = read_attachment(path)
            tokens = session.count_tokens(attachment.block())
            head = session.count_tokens(system) if system else 0
        except LocalchatError as exc:
            self.call_from_thread(
                self.notify, str(exc), title="Not attached", severity="error", timeout=15
            )
            return
        self.post_message(AttachmentReady(attachment, tokens, head))

    def on_attachment_ready(self, message: AttachmentReady) -> None:
        backend = self.backend
        if backend is None or self._torn_down():
            return
        pending = [*self._attachments, message.attachment]
        tokens = [*self._attachment_tokens, message.tokens]
        n_ctx = backend.context_size
        try:
            check_fits(pending, sum(tokens), message.head_tokens, n_ctx, self.max_tokens or 512)
        except LocalchatError as exc:
            self.notify(str(exc), title="Not attached", severity="error", timeout=15)
            return
        self._attachments, self._attachment_tokens = pending, tokens
        names = ", ".join(a.name for a in pending)
        self.query_one(StatsPanel).show_turn_start(
            f"attached {names}: goes with your next message (Esc removes)"
        )
        self.notify(f"Attached {message.attachment.name}: {message.tokens:,} tokens.")
        self.query_one(PromptInput).focus()
        self._read_ahead_box()  # the file is read while the question is typed

    async def action_new_chat(self) -> None:
        if self._generating or self.backend is None:
            return
        await self._close_conversation()
        assert self.session is not None
        await self._open_conversation(self.session.new_conversation_name())
        self.query_one(StatsPanel).show_turn_start("new conversation")

    async def action_regenerate(self) -> None:
        if self._generating or self.conversation is None:
            return
        self._end_edit()
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

        async def save(text: str | None) -> None:
            if text is None or self.conversation is not conversation:
                return
            if (text or None) == conversation.record.system_prompt:
                return
            if not conversation.exchanges:
                conversation.set_system_prompt(text)
                self.notify("System prompt saved.")
                return
            # Under another system prompt the conversation starts again, as a branch of its
            # own; the messages written under the old one stay on theirs.
            self._end_edit()
            conversation.branch_system_prompt(text)
            await self._show_transcript()
            self.query_one(StatsPanel).show_turn_start("new system prompt: a new branch")
            self.notify(
                "System prompt saved as a new branch: the conversation starts again under it."
                " The old branch is kept (select its first message, then ←)."
            )

        current = conversation.record.system_prompt or ""
        hint = "Ctrl+S saves (a conversation under way goes on as a new branch) · Esc cancels"
        title = "System prompt for this conversation"
        self.push_screen(TextPromptScreen(title, current, hint), save)

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
            if name and self.backend is not None and name != current:
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
        every = [*ChatEntry.BINDINGS, *UserMessage.BINDINGS, *AssistantMessage.BINDINGS]
        keys = [b for b in every if isinstance(b, Binding)]
        self.push_screen(HelpScreen(_BINDINGS, keys))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat shortcuts act on the chat screen only: inside a dialog its own keys win."""
        return not (action in _CHAT_ACTIONS and len(self.screen_stack) > 1)

    def action_copy_code(self) -> None:
        """Copy the last code block of the conversation."""
        replies = [r for r in self.query(AssistantMessage) if code_blocks(r.raw)]
        if not replies:
            self.notify("No code block in this conversation yet.")
            return
        language, code = code_blocks(replies[-1].raw)[-1]
        self.copy_to_clipboard(code)
        self.notify(f"Copied the last code block{f' ({language})' if language else ''}.")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand(
            "Copy code", "Copy the last code block of the conversation", self.action_copy_code
        )
        yield SystemCommand(
            "Edit the last question",
            "Edit it: sent again, it starts a new branch (the old one is kept)",
            self._edit_last_question,
        )
        for step, which in ((-1, "Previous"), (1, "Next")):
            yield SystemCommand(
                f"{which} branch",
                f"The {which.lower()} branch at the last message that has several",
                lambda step=step: self._step_last_branch(step),
            )
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
        if self.backend is not None:
            self.query_one(StatsPanel).show_cache(self.backend.cache_view(tokens, server_usage))

    def exit(self, *args: Any, **kwargs: Any) -> None:
        """Quitting stops a reply at once (the turn then commits what was written), and a
        first start's calibration or download at its next step."""
        self._cancel.set()
        self._startup_cancel.set()
        self._startup_skip.set()
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
            self.session.close(QUIT_WAIT_S, quitting=True)


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
