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

from localchat.server.runner import ModelRunner, TurnRecord

REDRAW_S = 1.0


class ServerLog:
    """The status line or the per-request lines of ``runner``, written to ``stream``."""

    def __init__(self, runner: ModelRunner, stream: TextIO, log_format: str = "text") -> None:
        self.runner = runner
        self.stream = stream
        self.json = log_format == "json"
        self.live = not self.json and stream.isatty()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        runner.on_turn = self.turn
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
        """The status line: what runs, how fast, how full the cache is, where prompts came from."""
        counters = self.runner.counters
        batch = self.runner.batch
        held, cells = batch.cells_used, batch.n_ctx_seq * batch.n_seq
        last = counters.last.get("gen_tps", 0.0)
        rates = self.runner.scheduler.rates()
        each = f" ({', '.join(f'{r:.1f}' for r in rates)} tok/s)" if rates else ""
        return (
            f"running {counters.running}/{batch.n_seq}{each} · waiting {counters.queued}"
            f" · last {last:.1f} tok/s · KV {held}/{cells} ({held / max(1, cells):.0%}) · prompt tokens"
            f" {counters.reused_tokens} cached, {counters.restored_tokens} from disk,"
            f" {counters.evaluated_tokens} evaluated · {len(self.runner.cache)} saved states"
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
