"""Live figures: KV cache memory, context fill, speeds, process memory."""

from __future__ import annotations

import time
from typing import ClassVar

import psutil
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Label, Sparkline, Static

from localchat.backends.base import BackendView, CacheView, TurnStats
from localchat.units import format_bytes

# While a reply streams, the speed and cache lines change at most this often.
LIVE_INTERVAL_S = 0.5


class FillBar(Widget):
    """How full the context is: one line of bar cells and a percentage, repainted in place
    when a cell changes. (Textual's ProgressBar re-renders a styled bar and handles an idle
    prompt each time; in a reply's first frame it cost more than the reply's text did.)"""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"fill-bar--filled", "fill-bar--empty"}

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.fraction = 0.0

    def show(self, fraction: float) -> None:
        """Repaint only when the fraction changed (a frame's stats mostly repeat it)."""
        fraction = min(max(fraction, 0.0), 1.0)
        if fraction != self.fraction:
            self.fraction = fraction
            self.refresh()

    def render(self) -> Text:
        """The cells and the percentage, both rounded down: full shows only when it is."""
        percent = f" {int(self.fraction * 100):3d}%"
        cells = max(self.size.width - len(percent), 0)
        filled = int(cells * self.fraction)
        return Text.assemble(
            ("━" * filled, self.get_component_rich_style("fill-bar--filled")),
            ("━" * (cells - filled), self.get_component_rich_style("fill-bar--empty")),
            percent,
        )


class StatsPanel(Vertical):
    """The side panel; the app feeds it stats, it formats them."""

    def __init__(self) -> None:
        super().__init__(id="stats")
        self._speeds: list[float] = []
        self._process = psutil.Process()
        self._live_shown_at = 0.0

    def compose(self) -> ComposeResult:
        yield Label("Model", classes="heading")
        yield Static("loading…", id="model-info")
        yield Label("KV cache", classes="heading")
        yield Static("", id="kv-memory")
        yield FillBar(id="ctx-fill")
        yield Static("", id="ctx-tokens")
        yield Label("Speed", classes="heading")
        yield Static(Text("no reply yet"), id="speed")
        yield Sparkline([], id="speed-history")
        yield Static("", id="turn-start")
        yield Label("Memory", classes="heading")
        yield Static("", id="ram")

    def on_mount(self) -> None:
        self.refresh_memory()
        self.set_interval(1.0, self.refresh_memory)

    def _set(self, widget_id: str, text: str, layout: bool = False) -> None:
        """The figures that change while a reply streams have fixed heights (app.tcss): a
        repaint of their own lines is enough, without a layout of the whole screen."""
        self.query_one(f"#{widget_id}", Static).update(Text(text), layout=layout)

    def show_backend(self, view: BackendView) -> None:
        """What answers: a model here (its file, cache type, context, template, buffers) or
        a model on a server (where it runs, its context where the server says)."""
        self._set("model-info", view.panel, layout=True)

    def show_cache(self, view: CacheView) -> None:
        """The KV cache: bytes held here, or the server's fill where its /metrics says
        (never a zero for a cache that is not here)."""
        if view.used_bytes is not None and view.allocated_bytes is not None:
            memory = f"{format_bytes(view.used_bytes)} / {format_bytes(view.allocated_bytes)}"
        elif view.server_usage is None:
            memory = "server-side (not published)"
        else:
            memory = f"server-side, {100 * view.server_usage:.0f}% in use"
        self._set("kv-memory", memory)
        self.query_one(FillBar).show(view.tokens / view.n_ctx if view.n_ctx else 0.0)
        about = "" if view.counted else "≈"
        limit = f" / {view.n_ctx:,}" if view.n_ctx else ""
        self._set("ctx-tokens", f"{about}{view.tokens:,}{limit} tokens")

    def live_due(self) -> bool:
        """Whether the live lines (speed, cache) are due for a change while a reply streams
        (True: counted as shown now)."""
        now = time.perf_counter()
        if now - self._live_shown_at < LIVE_INTERVAL_S:
            return False
        self._live_shown_at = now
        return True

    def show_speed(self, stats: TurnStats, ttft_s: float, final: bool = False) -> None:
        """``ttft_s``: from the message being sent (Enter) to its first token."""
        drafts = ""
        if stats.drafted_tokens:
            accepted = stats.accepted_tokens / stats.drafted_tokens
            drafts = f"\ndrafts {accepted:.0%} accepted"
            if stats.speculative_speedup:
                drafts += f" · ×{stats.speculative_speedup:.2f}"
        self._set(
            "speed",
            f"gen {stats.gen_tps:.1f} tok/s\nprompt {stats.prompt_tps:.1f} tok/s\n"
            f"first token {ttft_s:.2f} s{drafts}",
        )
        if final and stats.gen_tps > 0:
            self._speeds = [*self._speeds[-29:], stats.gen_tps]
            self.query_one(Sparkline).data = self._speeds

    def show_turn_start(self, text: str) -> None:
        self._set("turn-start", text)

    def refresh_memory(self) -> None:
        rss = self._process.memory_info().rss
        free = psutil.virtual_memory().available
        self._set("ram", f"process {format_bytes(rss)}\nfree RAM {format_bytes(free)}")
