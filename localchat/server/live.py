"""What a running server shows where it was started.

On a terminal: one status line redrawn in place each second — requests running and
waiting, the last reply's tokens/s, the KV cache's fill and where prompt tokens came from
(held in memory, restored from disk, evaluated) — not scrolling logs. Elsewhere (a service,
a pipe): one line per request, or one JSON object per request with ``--log-format json``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from typing import TextIO

from localchat.server.router import ModelStatus, Router
from localchat.server.runner import TurnRecord

REDRAW_S = 1.0


class ServerLog:
    """The status line or the per-request lines of the models served, written to
    ``stream``."""

    def __init__(self, models: Router, stream: TextIO, log_format: str = "text") -> None:
        self.models = models
        self.stream = stream
        self.json = log_format == "json"
        self.live = not self.json and stream.isatty()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        models.on_turn = self.turn
        self._thread: threading.Thread | None = None
        if self.live:
            self._thread = threading.Thread(target=self._redraw, name="serve-status", daemon=True)
            self._thread.start()

    def turn(self, record: TurnRecord) -> None:
        """A request answered (the compute thread calls this)."""
        if self.live:
            return  # the status line says it
        text = (
            json.dumps({"time": round(time.time(), 3), **asdict(record)})
            if self.json
            else record.line()
        )
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()

    def status(self) -> str:
        """The status line: each loaded model's requests, speed, cache fill and where its
        prompts came from; how many models are served."""
        statuses = self.models.statuses()
        loaded = [self._model_status(s) for s in statuses if s.runner is not None]
        if not loaded:
            return f"no model loaded · {len(statuses)} served, each loaded when asked for"
        return (
            " | ".join(loaded)
            if len(statuses) == 1
            else (f"{len(loaded)}/{len(statuses)} loaded: " + " | ".join(loaded))
        )

    @staticmethod
    def _model_status(status: ModelStatus) -> str:
        runner = status.runner
        assert runner is not None
        counters, batch = runner.counters, runner.batch
        held, cells = batch.cells_used, batch.n_ctx_seq * batch.n_seq
        last = counters.last.get("gen_tps", 0.0)
        rates = runner.scheduler.rates()
        each = f" ({', '.join(f'{r:.1f}' for r in rates)} tok/s)" if rates else ""
        idle = f" · idle {status.idle_s:.0f} s" if status.idle_s and status.idle_s >= 1 else ""
        return (
            f"{runner.model_name}: running {counters.running}/{batch.n_seq}{each} · waiting"
            f" {counters.queued} · last {last:.1f} tok/s · KV {held}/{cells}"
            f" ({held / max(1, cells):.0%}) · prompt tokens {counters.reused_tokens} cached,"
            f" {counters.restored_tokens} from disk, {counters.evaluated_tokens} evaluated ·"
            f" {len(runner.cache)} saved states · {runner.memory_bytes / 2**20:.0f} MB{idle}"
        )

    def _redraw(self) -> None:
        while not self._stop.wait(REDRAW_S):
            with self._lock:
                self.stream.write("\r\x1b[2K" + self.status())
                self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            with self._lock:
                self.stream.write("\n")
