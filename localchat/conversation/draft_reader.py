"""The message being typed, read ahead while it is typed (setting ``type_ahead``).

One reader runs at a time and always reads the newest text; each of its steps runs on the
compute thread and gives way at once to anything else asked of it (the turn Enter starts, a
pin or a branch switch, a model switch, a restore). The app offers it the box's text and
runs ``run`` in a worker; nothing here knows about the UI.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from localchat.backends.compute_thread import compute_waiting, run_compute
from localchat.conversation.base import ConversationBase
from localchat.conversation.turn import ReadAheadResult

_log = logging.getLogger(__name__)

# What ``run`` reports after each step that changed it: the conversation's id, the tokens
# read ahead of it, and what the cache holds in all.
ReadAheadReport = Callable[[str, int, int], None]


class DraftReader:
    """Coordinates reading ahead between the thread that sees the typing and the worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conversation: ConversationBase | None = None
        self._draft = ""
        self._version = 0  # counts the text's changes: a step for older text gives way
        self._running = False
        self._stopped = False
        self.steps_given_way = 0  # steps that stopped early for other work (for tests)

    @property
    def running(self) -> bool:
        with self._lock:
            return self._running

    def offer(self, conversation: ConversationBase, text: str) -> bool:
        """The message box now holds ``text`` for ``conversation``. True when the caller is
        to start a worker running ``run``; False when one runs (it picks the text up) or
        nothing is read (the conversation's backend keeps no cache here, or quitting)."""
        if not conversation.reads_ahead:
            return False
        with self._lock:
            self._conversation = conversation
            self._draft = text
            self._version += 1
            if self._running or self._stopped:
                return False
            self._running = True
            return True

    def forget(self) -> None:
        """The conversation closes: a running reader stops after its step."""
        with self._lock:
            self._conversation = None

    def stop(self) -> None:
        """Quitting: nothing more is read, and a step under way ends at its next check."""
        with self._lock:
            self._stopped = True
            self._conversation = None

    def run(self, max_tokens: int, report: ReadAheadReport) -> None:
        """Read the newest text ahead until it is read (in a worker thread; each step on the
        compute thread). ``max_tokens``: the reply's room, which the window plan keeps."""
        done: tuple[ConversationBase, int] | None = None
        shown: tuple[str, int] | None = None
        try:
            while True:
                with self._lock:
                    conversation, draft, version = self._conversation, self._draft, self._version
                    if conversation is None or self._stopped or done == (conversation, version):
                        self._running = False
                        return
                result, kv_tokens = run_compute(
                    self._step, conversation, draft, version, max_tokens
                )
                if result.finished:
                    done = (conversation, version)
                else:
                    self.steps_given_way += 1
                if (conversation.record.id, result.tokens) != shown:
                    shown = (conversation.record.id, result.tokens)
                    report(conversation.record.id, result.tokens, kv_tokens)
        except BaseException:
            with self._lock:
                self._running = False
            raise

    def _step(
        self, conversation: ConversationBase, draft: str, version: int, max_tokens: int
    ) -> tuple[ReadAheadResult, int]:
        """On the compute thread: what was read ahead, and what the cache holds in all."""
        if conversation.closed or self._stopped:  # its model and stores may be gone too
            return ReadAheadResult(0), 0
        if version != self._version:  # typed on since: the newer text is read instead
            return ReadAheadResult(0, finished=False), 0
        try:
            result = conversation.read_ahead(draft, max_tokens, self._give_way)
        except Exception as exc:  # reading ahead is a bonus: the turn will say what is wrong
            _log.warning("reading ahead failed: %s", exc)
            return ReadAheadResult(0), 0
        return result, conversation.context_tokens()

    def _give_way(self) -> bool:
        return self._stopped or compute_waiting()
