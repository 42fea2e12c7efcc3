"""Models: catalog quants with size, memory, fit and download state; download, switch, add;
and the models of the servers named in settings.toml, beside them.

Returns the path of the model to switch to (after a download if needed), a server model to
chat through, or None.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, ProgressBar, Static

from localchat.backends.servers import ServerModelRow, server_model_rows
from localchat.errors import LocalchatError
from localchat.gguf.info import is_projector
from localchat.models.hardware import Hardware, detect_hardware
from localchat.models.hub import DownloadCancelled
from localchat.models.library import Library, ModelRow
from localchat.models.planner import MIN_TOKENS_PER_S, format_tps
from localchat.paths import app_paths
from localchat.progress import Progress
from localchat.settings import ServerConfig
from localchat.tui.screens.text_prompt import TextPromptScreen
from localchat.tui.worker_failures import ReportsWorkerFailures
from localchat.units import format_bytes

COLUMNS = ("Model", "Quant", "Size", "Needs", "Speed", "Fit", "On disk")
LOADED = "● loaded"  # the model the app runs now


def _model_cells(row: ModelRow, loaded: bool = False) -> tuple[str | Text, ...]:
    """A model's row: file facts, the plan's figures, and whether it is here (``loaded``:
    the model the app runs now, in its one engine)."""
    needs = format_bytes(row.estimated_bytes) if row.estimated_bytes else "-"
    on_disk: str | Text = "✓" if row.downloaded else ""
    if row.source in ("local", "demo"):
        on_disk = "added" if row.source == "local" else "demo"
    if loaded:
        on_disk = LOADED
    if row.problem:
        on_disk = Text(f"unusable: {row.problem}")  # a file name is never markup
    speed = f"~{format_tps(row.predicted_gen_tps)} tok/s" if row.predicted_gen_tps else "-"
    quant = f"{row.quant} ★" if row.planned else row.quant  # the planner's pick here
    return (row.model, quant, format_bytes(row.size_bytes), needs, speed, row.fit, on_disk)


def _server_cells(row: ServerModelRow) -> tuple[str | Text, ...]:
    """A configured server's model (names are never markup)."""
    context = f"ctx {row.context_size}" if row.context_size else "-"
    where = Text(f"server {row.server}" + (f": {row.problem}" if row.problem else ""))
    return (Text(row.model or "(unreachable)"), "server", "-", context, "-", "remote", where)


@dataclass
class RowsLoaded(Message):
    rows: list[ModelRow]
    server_rows: list[ServerModelRow]
    loaded: int | None = None  # the row of the model loaded now, if listed


def loaded_row(rows: list[ModelRow], loaded: Path | None) -> int | None:
    """The row whose file is ``loaded`` (the same file by any path: a link, a relative
    path), if one is; read off the app's thread, it touches the disk."""
    if loaded is None:
        return None
    target = os.path.realpath(loaded)
    for index, row in enumerate(rows):
        if row.path is not None and os.path.realpath(row.path) == target:
            return index
    return None


@dataclass(frozen=True)
class ServerChoice:
    """A model on a configured server, picked in the table."""

    server: str  # its name in settings.toml
    model: str


@dataclass
class DownloadProgress(Message):
    progress: Progress


@dataclass
class DownloadFinished(Message):
    path: Path | None
    error: str | None


class ModelsScreen(ReportsWorkerFailures, ModalScreen[Path | ServerChoice | None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close / cancel download", id="models-close"),
        Binding("enter", "pick", "Download or switch", id="models-pick", priority=True),
        Binding("ctrl+a", "add", "Add a local GGUF", id="models-add", priority=True),
    ]

    def __init__(
        self,
        hardware: Hardware | None = None,
        min_tps: float = MIN_TOKENS_PER_S,
        servers: tuple[ServerConfig, ...] = (),
        loaded: Path | None = None,
    ) -> None:
        """``loaded``: the model file the app runs now (None: none here, or a server's)."""
        super().__init__(classes="dialog-screen")
        self.loaded = loaded
        self.servers = servers  # settings.toml's [[servers]]: their models are listed too
        self.server_rows: list[ServerModelRow] = []
        self.hardware = hardware  # None: detect this machine
        self.min_tps = min_tps  # the user's min_tokens_per_s setting
        self.rows: list[ModelRow] = []
        self.library: Library | None = None
        self.cancel = threading.Event()
        self.downloading = False

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label("Models", classes="dialog-title")
            yield DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
            yield ProgressBar(total=1, id="download-bar", show_eta=False)
            yield Static("", id="download-status")
            yield Label(
                "★ the planner's pick here · Speed: predicted generation on this machine ·"
                " Enter downloads or switches · Ctrl+A adds a local GGUF · Esc cancels / closes",
                classes="dialog-hint",
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.query_one("#download-bar").display = False
        table.focus()
        self.load_rows()

    @work(thread=True, exit_on_error=False, exclusive=True, group="models-rows")
    def load_rows(self) -> None:
        try:
            self.library = self.library or Library(
                app_paths(), self.hardware or detect_hardware(), min_tps=self.min_tps
            )
            rows = [r for r in self.library.rows() if r.kind == "chat"]  # chats only
        except LocalchatError as exc:
            self.post_message(DownloadFinished(None, str(exc)))
            return
        servers = server_model_rows(self.servers)
        self.post_message(RowsLoaded(rows, servers, loaded_row(rows, self.loaded)))

    def on_rows_loaded(self, message: RowsLoaded) -> None:
        self.rows = message.rows
        self.server_rows = message.server_rows
        cells = [_model_cells(row, i == message.loaded) for i, row in enumerate(self.rows)]
        cells += [_server_cells(row) for row in self.server_rows]
        keys = [str(i) for i in range(len(self.rows))]
        keys += [f"server-{i}" for i in range(len(self.server_rows))]
        table = self.query_one(DataTable)
        # Each column as wide as its widest cell, set with the rows: sized on idle instead,
        # the table could be drawn with its header's widths first (a flaky snapshot).
        table.clear(columns=True)
        for index, label in enumerate(COLUMNS):
            widest = max((cell_len(str(row[index])) for row in cells), default=0)
            table.add_column(label, width=max(widest, len(label)))
        for key, row in zip(keys, cells, strict=True):
            table.add_row(*row, key=key)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """The highlighted model's plan here, and why, under the table."""
        row = self._selected()
        if row is not None and row.plan and not self.downloading:
            self.query_one("#download-status", Static).update(Text(f"{row.model}: {row.plan}"))

    def _selected(self) -> ModelRow | None:
        table = self.query_one(DataTable)
        if not self.rows or table.row_count == 0 or table.cursor_row >= len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def _selected_server_row(self) -> ServerModelRow | None:
        index = self.query_one(DataTable).cursor_row - len(self.rows)
        return self.server_rows[index] if 0 <= index < len(self.server_rows) else None

    def action_pick(self) -> None:
        server_row = self._selected_server_row()
        if server_row is not None and not self.downloading:
            if server_row.model is None:
                self.notify(server_row.problem or "unreachable", severity="warning", timeout=10)
            else:
                self.dismiss(ServerChoice(server_row.server, server_row.model))
            return
        row = self._selected()
        if row is None or self.downloading:
            return
        if row.usable and row.path:
            self.dismiss(Path(row.path))
            return
        resumable = row.fit == "partial" and not is_projector(row.file)
        if row.problem and not resumable:  # a projector, a broken file: say why, load nothing
            self.notify(row.problem, severity="warning", timeout=10)
            return
        if row.source != "catalog" and not resumable:
            return
        self.downloading = True
        self.cancel.clear()
        self.query_one("#download-bar").display = True
        self.download(f"{row.model}:{row.quant}")

    @work(thread=True, exit_on_error=False, exclusive=True, group="models-download")
    def download(self, spec: str) -> None:
        assert self.library is not None
        try:
            library = self.library
            path = library.pull(
                library.request(spec), lambda p: self.post_message(DownloadProgress(p)), self.cancel
            )
        except DownloadCancelled as exc:
            self.post_message(DownloadFinished(None, str(exc)))
            return
        except LocalchatError as exc:
            self.post_message(DownloadFinished(None, str(exc)))
            return
        self.post_message(DownloadFinished(path, None))

    def on_download_progress(self, message: DownloadProgress) -> None:
        progress = message.progress
        self.query_one(ProgressBar).update(
            total=max(1, progress.bytes_total), progress=progress.bytes_done
        )
        self.query_one("#download-status", Static).update(
            Text(f"{progress.name}: " + progress.summary())
        )

    def on_download_finished(self, message: DownloadFinished) -> None:
        self.downloading = False
        self.query_one("#download-bar").display = False
        if message.error:
            self.query_one("#download-status", Static).update(Text(message.error))
            self.notify(message.error, severity="warning", timeout=15)
            return
        self.dismiss(message.path)

    def action_close(self) -> None:
        if self.downloading:
            self.cancel.set()
            return
        self.dismiss(None)

    def action_add(self) -> None:
        def add(text: str | None) -> None:
            if not text or self.library is None:
                return
            try:
                self.notify(self.library.add_local(Path(text).expanduser()))
            except LocalchatError as exc:
                self.notify(str(exc), severity="error", timeout=15)
                return
            self.load_rows()

        self.app.push_screen(
            TextPromptScreen("Add a local GGUF file: its path", hint="Ctrl+S adds · Esc cancels"),
            add,
        )
