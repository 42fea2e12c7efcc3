"""The localchat app: chat with streamed replies and live KV-cache figures.

Blocking runtime calls (model load, generation) run in thread workers that only post typed
messages; every widget change happens on the app's thread.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Markdown
from textual.widgets.markdown import MarkdownStream

from localchat.conversation import Conversation, ConversationTurn
from localchat.engine import Engine, LoadOptions, Sampling
from localchat.errors import LocalchatError
from localchat.kvstate import StateStore
from localchat.paths import app_paths
from localchat.settings import load_settings
from localchat.store import Store
from localchat.tui.messages import (
    ModelLoaded,
    ModelLoadFailed,
    ReplyChunk,
    ReplyFailed,
    ReplyFinished,
)
from localchat.tui.widgets.chat_message import AssistantMessage, Notice, UserMessage
from localchat.tui.widgets.prompt_input import PromptInput
from localchat.tui.widgets.stats_panel import StatsPanel

# Chunks are posted at most this often, so a fast model does not flood the UI.
CHUNK_INTERVAL_S = 0.05


class LocalChatApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "localchat"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "escape",
            "stop",
            "Stop",
            tooltip="Stop generating; the partial reply is kept",
            id="stop",
        ),
        Binding(
            "ctrl+n", "new_chat", "New chat", tooltip="Start a new conversation", id="new-chat"
        ),
        Binding("ctrl+q", "quit", "Quit", id="quit"),
    ]

    def __init__(
        self,
        model_path: Path,
        n_ctx: int = 4096,
        max_tokens: int = 512,
        sampling: Sampling | None = None,
        conversation_name: str | None = None,
        system_prompt: str | None = None,
    ) -> None:
        super().__init__()
        self.system_prompt = system_prompt
        self.model_path = model_path
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        self.sampling = sampling or Sampling()
        self.conversation_name = conversation_name
        self.engine: Engine | None = None
        self.conversation: Conversation | None = None
        self.store: Store | None = None
        self.states: StateStore | None = None
        self._cancel = threading.Event()
        self._generating = False
        self._reply: AssistantMessage | None = None
        self._user_view: UserMessage | None = None
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="log")
                yield PromptInput(id="input", placeholder="Message (Enter sends, Ctrl+J new line)")
            yield StatsPanel()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"loading {self.model_path.name}…"
        self.query_one(PromptInput).focus()
        paths = app_paths()
        try:
            settings = load_settings(paths.settings_file)
            self.store = Store(paths.database)
        except LocalchatError as exc:
            self.notify(str(exc), title="Conversations unavailable", severity="error", timeout=30)
        else:
            self.states = StateStore(paths.states_dir, settings.state_budget_bytes)
        self.load_model()

    # -- workers (thread): they only post messages -------------------------------------
    @work(thread=True, exclusive=True, group="model")
    def load_model(self) -> None:
        start = time.perf_counter()
        try:
            engine = Engine(self.model_path, LoadOptions(n_ctx=self.n_ctx))
        except LocalchatError as exc:
            self.post_message(ModelLoadFailed(str(exc)))
            return
        self.post_message(ModelLoaded(engine, time.perf_counter() - start))

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, conversation: Conversation, text: str) -> None:
        try:
            turn = conversation.send(text, self.sampling, self.max_tokens, self._cancel)
        except LocalchatError as exc:
            self.post_message(ReplyFailed(str(exc), text))
            return
        except Exception as exc:  # the app stays up whatever the runtime raises
            self.post_message(ReplyFailed(f"unexpected error: {exc}", text))
            return
        pending = ""
        last_post = time.perf_counter()
        engine = conversation.engine
        try:
            for delta in turn:
                pending += delta.text
                now = time.perf_counter()
                if now - last_post >= CHUNK_INTERVAL_S:
                    self.post_message(ReplyChunk(pending, turn.stats, len(engine.cached_tokens)))
                    pending, last_post = "", now
        except Exception as exc:
            self.notify(f"generation failed: {exc}", severity="error", timeout=15)
        if pending:
            self.post_message(ReplyChunk(pending, turn.stats, len(engine.cached_tokens)))
        self.post_message(ReplyFinished(turn.stats, len(engine.cached_tokens), turn))

    # -- message handlers (app thread) -------------------------------------------------
    async def on_model_loaded(self, message: ModelLoaded) -> None:
        self.engine = message.engine
        info = message.engine.info
        self.sub_title = f"{info.name} · {info.file_type}"
        panel = self.query_one(StatsPanel)
        panel.show_model(
            info.name,
            info.file_type,
            message.engine.options.kv_type,
            message.engine.n_ctx,
            message.engine.options.n_gpu_layers,
        )
        self._show_cache(0)
        panel.show_turn_start(f"model loaded in {message.load_s:.2f} s")
        await self._open_conversation(self.conversation_name)

    async def _open_conversation(self, name: str | None) -> None:
        """Open ``name`` (default: the most recent conversation, or a new one)."""
        if self.engine is None or self.store is None or self.states is None:
            return
        if name is None:
            recent = self.store.list()
            name = recent[0].name if recent else _new_conversation_name()
        try:
            conversation = Conversation.open(
                self.store, self.states, name, self.engine, self.system_prompt
            )
        except LocalchatError as exc:
            self.notify(str(exc), severity="warning", timeout=15)
            conversation = Conversation.open(
                self.store, self.states, _new_conversation_name(), self.engine
            )
        conversation.saver.on_error = lambda error: self.notify(error, severity="warning")
        self.conversation = conversation
        self.title = f"localchat — {conversation.record.title}"
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        for exchange in conversation.exchanges:
            if exchange.record.role == "user":
                await log.mount(UserMessage(exchange.record.content))
            elif exchange.record.role == "assistant":
                view = AssistantMessage()
                await log.mount(view)
                await view.markdown.update(view.append(exchange.record.content))
        log.scroll_end(animate=False)

    def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        self.sub_title = "no model"
        self.notify(message.error, title="Model failed to load", severity="error", timeout=30)

    @on(PromptInput.Submitted)
    async def send(self, message: PromptInput.Submitted) -> None:
        if self.conversation is None:
            self.notify("The model is still loading; your message is kept.", severity="warning")
            return
        if self._generating:
            self.notify("Still answering; press Esc to stop first.", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        prompt.clear()
        log = self.query_one("#log", VerticalScroll)
        self._reply = AssistantMessage()
        self._user_view = UserMessage(message.text)
        await log.mount_all([self._user_view, self._reply])
        log.anchor()
        self._stream = Markdown.get_stream(self._reply.markdown)
        self._cancel.clear()
        self._generating = True
        self.generate(self.conversation, message.text)

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        if self._reply is not None and self._stream is not None:
            await self._stream.write(self._reply.append(message.text))
        self.query_one(StatsPanel).show_speed(message.stats)
        self._show_cache(message.kv_tokens)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        await self._end_stream()
        stats = message.stats
        panel = self.query_one(StatsPanel)
        panel.show_speed(stats, final=True)
        panel.show_turn_start(describe_turn_start(message.turn))
        self._show_cache(message.kv_tokens)
        log = self.query_one("#log", VerticalScroll)
        for notice in message.turn.notices:
            await log.mount(Notice(notice))
        if stats.stop_reason == "cancelled":
            await log.mount(Notice("stopped — the partial reply is kept"))
        self._generating = False

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
        if self.conversation is not None:
            self.conversation.close()
            self.conversation = None
        await self._open_conversation(_new_conversation_name())
        self.query_one(StatsPanel).show_turn_start("new conversation")

    # -- helpers ------------------------------------------------------------------------
    async def _end_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    def _show_cache(self, tokens: int) -> None:
        if self.engine is None:
            return
        engine = self.engine
        self.query_one(StatsPanel).show_cache(
            tokens * engine.kv_bytes_per_token, engine.kv_bytes_allocated, tokens, engine.n_ctx
        )

    def on_unmount(self) -> None:
        self._cancel.set()
        if self.conversation is not None:
            self.conversation.close()  # waits for the last state save
        if self.store is not None:
            self.store.close()


def _new_conversation_name() -> str:
    return time.strftime("chat-%Y%m%d-%H%M%S")


def describe_turn_start(turn: ConversationTurn) -> str:
    """How the turn began: restored from disk, reused from memory, or evaluated."""
    stats = turn.stats
    restore = turn.restore
    evaluated = f"evaluated {stats.prompt_tokens_evaluated:,} tokens in {stats.ttft_s:.2f} s"
    if restore.restored:
        return f"restored {restore.tokens:,} tokens from saved cache in {restore.seconds:.2f} s\n{evaluated}"
    reused = stats.prompt_tokens - stats.prompt_tokens_evaluated
    return evaluated + (f"\nreused {reused:,} from the cache" if reused else "")


def run_app(model_path: Path, n_ctx: int = 4096, conversation: str | None = None) -> int:
    app = LocalChatApp(model_path, n_ctx=n_ctx, conversation_name=conversation)
    app.run()
    return app.return_code or 0
