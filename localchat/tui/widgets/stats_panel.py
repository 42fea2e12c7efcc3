"""Live figures: KV cache memory, context fill, speeds, process memory."""

from __future__ import annotations

import psutil
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, ProgressBar, Sparkline, Static

from localchat.backends.base import TurnStats
from localchat.units import format_bytes


class StatsPanel(Vertical):
    """The side panel; the app feeds it stats, it formats them."""

    def __init__(self) -> None:
        super().__init__(id="stats")
        self._speeds: list[float] = []
        self._process = psutil.Process()

    def compose(self) -> ComposeResult:
        yield Label("Model", classes="heading")
        yield Static("loading…", id="model-info")
        yield Label("KV cache", classes="heading")
        yield Static("", id="kv-memory")
        yield ProgressBar(total=1, show_eta=False, id="ctx-fill")
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

    def show_model(
        self,
        name: str,
        quant: str,
        kv_type: str,
        n_ctx: int,
        gpu_layers: int,
        template: str,
        buffers: str = "",
    ) -> None:
        """``buffers``: what llama.cpp allocated besides the KV cache, as the engine says."""
        self._set(
            "model-info",
            f"{name}\n{quant} · KV {kv_type} · ctx {n_ctx}\nGPU layers {gpu_layers}"
            f"\ntemplate: {template}" + (f"\n{buffers}" if buffers else ""),
            layout=True,
        )

    def show_server(self, model: str, server: str, n_ctx: int | None) -> None:
        """A model on a server: its name, where it runs, its context where the server says."""
        context = f"ctx {n_ctx}" if n_ctx else "ctx not published by the server"
        self._set("model-info", f"{model}\non {server}\n{context}", layout=True)

    def show_server_cache(
        self, usage: float | None, tokens: int, n_ctx: int | None, counted: bool
    ) -> None:
        """The cache is the server's: its fill where its /metrics says, never a zero here."""
        if usage is None:
            self._set("kv-memory", "server-side (not published)")
        else:
            self._set("kv-memory", f"server-side, {100 * usage:.0f}% in use")
        bar = self.query_one("#ctx-fill", ProgressBar)
        bar.update(total=n_ctx or 1, progress=tokens if n_ctx else 0)
        about = "" if counted else "≈"
        limit = f" / {n_ctx:,}" if n_ctx else ""
        self._set("ctx-tokens", f"{about}{tokens:,}{limit} tokens")

    def show_cache(self, used_bytes: int, allocated_bytes: int, tokens: int, n_ctx: int) -> None:
        self._set("kv-memory", f"{format_bytes(used_bytes)} / {format_bytes(allocated_bytes)}")
        bar = self.query_one("#ctx-fill", ProgressBar)
        bar.update(total=n_ctx, progress=tokens)
        self._set("ctx-tokens", f"{tokens:,} / {n_ctx:,} tokens")

    def show_speed(self, stats: TurnStats, ttft_s: float, final: bool = False) -> None:
        """``ttft_s``: from the message being sent (Enter) to its first token."""
        self._set(
            "speed",
            f"gen {stats.gen_tps:.1f} tok/s\nprompt {stats.prompt_tps:.1f} tok/s\n"
            f"first token {ttft_s:.2f} s",
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
