"""One conversation on one model: a turn is store → restore → evaluate → stream → store → save.

The transcript (SQLite) is the truth; the saved KV state is a cache of it. Before a turn the
state is validated against the model, the context and the transcript's token ids, and only
what it does not hold is evaluated. After a turn the new state is saved in the background.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from localchat.backends.base import Reply, Sampling, TokenDelta, TurnStats
from localchat.backends.llama.engine import Engine, ReplayStopped
from localchat.chat.prompt import BuiltPrompt, common_prefix, settled_chars
from localchat.chat.template import ChatMessage
from localchat.chat.window import WindowPlan, WindowPolicy, plan_window, resolve_mode, shift_is_safe
from localchat.conversation.prefix_states import (
    DEFAULT_MIN_TOKENS,
    PrefixStart,
    prefix_spans,
    start_from_prefix,
)
from localchat.errors import UsageError
from localchat.state.kvstate import BackgroundSaver, SavedState, StateRejected, StateStore
from localchat.state.locks import ConversationLock
from localchat.state.store import ConversationRecord, MessageRecord, Store

NO_STATE = "no saved state"
# Re-tokenizing a cut message can take a few more tokens than counted; leave this much room.
CUT_MARGIN_TOKENS = 8
# Tokens a message being typed is read ahead by at a time: Enter, or anything else asked of
# the compute thread, waits at most this many tokens' evaluation.
READ_AHEAD_BATCH = 16


@dataclass
class RestoreReport:
    """How the turn's cache was prepared: restored from disk, reused in memory, or rebuilt.

    ``replayed`` tokens were re-evaluated from the transcript before the turn (in their
    original batches); ``seconds`` covers the restore or the replay.
    """

    restored: bool = False
    tokens: int = 0
    seconds: float = 0.0
    notice: str | None = None
    replayed: int = 0
    prefix_tokens: int = 0  # restored from a shared prefix state (a known system prompt)
    read_ahead: int = 0  # prompt tokens evaluated while the message was being typed

    @classmethod
    def from_prefix(cls, start: PrefixStart | None, notice: str | None = None) -> RestoreReport:
        """How a cold start began: a prefix restored, or read and saved (counted as read
        before the turn), or nothing (None)."""
        if start is None:
            return cls(notice=notice)
        return cls(
            seconds=start.seconds,
            notice=notice,
            replayed=start.evaluated,
            prefix_tokens=start.restored,
        )


@dataclass
class _ReadAhead:
    """A message being read ahead: how the cache was prepared for it (a restore, a known
    system prompt: already paid for when it is sent), and what the last full read covered.
    The tokens read are the cache's past ``Engine.committed``."""

    report: RestoreReport = field(default_factory=RestoreReport)
    settled: tuple[str, str | None, int | None, int] | None = None


@dataclass(frozen=True)
class ReadAheadResult:
    """How many tokens the cache holds ahead of the conversation, and whether reading went
    as far as it could (False: it gave way to other work, and is to be asked again)."""

    tokens: int
    finished: bool = True


@dataclass
class Exchange:
    """A message as the conversation knows it: the stored record and its prompt form."""

    record: MessageRecord
    prompt: ChatMessage


@dataclass
class ConversationTurn:
    """A turn in progress; iterate for deltas. The reply is committed and the state saved when
    iteration ends, however it ends (finished, cancelled, interrupted)."""

    conversation: ConversationBase
    user: Exchange
    prompt: BuiltPrompt
    generation: Reply
    restore: RestoreReport
    started_at: float
    window: WindowReport
    messages: list[ChatMessage]  # what the prompt was built from (the window)
    reply: Exchange | None = None
    notices: list[str] = field(default_factory=list)
    # When the user sent the message (Enter in the app; else when ``send`` began), on
    # ``time.perf_counter``'s clock.
    entered_at: float = 0.0

    def __iter__(self) -> Iterator[TokenDelta]:
        try:
            yield from self.generation
        finally:
            self.reply = self.conversation._finish(self)

    @property
    def stats(self) -> TurnStats:
        return self.generation.stats

    @property
    def resume_ttft_s(self) -> float:
        """Time to first token including the restore: what the user waited."""
        return self.restore.seconds + self.generation.stats.ttft_s

    @property
    def sent_ttft_s(self) -> float:
        """From the message being sent (Enter) to the first token: everything the user
        waited for, a step of reading ahead that was finishing included."""
        first = self.generation.stats.first_token_at
        if first is None:
            return self.resume_ttft_s
        return first - (self.entered_at or self.started_at)

    def stats_dict(self) -> dict[str, Any]:
        stats = turn_stats_dict(self.generation.stats, self.restore, self.window, self.prompt)
        stats["sent_ttft_s"] = round(self.sent_ttft_s, 6)
        return stats


@dataclass(frozen=True)
class WindowReport:
    """What the window did this turn: how much left it, and how the cache followed."""

    mode: str = "none"  # "none" (it did not move), "shift" or "exact"
    dropped_messages: int = 0
    dropped_tokens: int = 0
    cut_tokens: int = 0
    kept_pinned: int = 0  # pinned messages among the old ones: they stay in the window


def turn_stats_dict(
    stats: TurnStats,
    restore: RestoreReport | None = None,
    window: WindowReport | None = None,
    prompt: BuiltPrompt | None = None,
) -> dict[str, Any]:
    """A turn's figures as ``ask --json`` and the stored message report them."""
    restore = restore or RestoreReport()
    window = window or WindowReport()
    prompt = prompt or BuiltPrompt([])
    return {
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_evaluated": stats.prompt_tokens_evaluated + restore.replayed,
        # Of the prompt, what came from the cache (in memory, restored, read ahead) unread.
        "kept_tokens": max(
            0, stats.prompt_tokens - stats.prompt_tokens_evaluated - restore.replayed
        ),
        "generated_tokens": stats.generated_tokens,
        "ttft_s": round(restore.seconds + stats.ttft_s, 6),
        "prompt_tps": round(stats.prompt_tps, 3),
        "gen_tps": round(stats.gen_tps, 3),
        "kv_bytes_used": stats.kv_bytes_used,
        "kv_bytes_allocated": stats.kv_bytes_allocated,
        "server_kv_usage": stats.server_kv_usage,
        "tokens_counted_by": stats.counted,
        "restored_from_state": restore.restored,
        "restored_tokens": restore.tokens,
        "restored_prefix_tokens": restore.prefix_tokens,
        "read_ahead_tokens": restore.read_ahead,
        "restore_s": round(restore.seconds, 6),
        "window_dropped_messages": window.dropped_messages,
        "window_dropped_tokens": window.dropped_tokens,
        "window_cut_tokens": window.cut_tokens,
        "window_mode": window.mode,
        "history_reevaluated_tokens": prompt.discarded,
        "history_reevaluated_reason": prompt.discarded_reason,
        "stop_reason": stats.stop_reason,
    }


def open_record(
    store: Store, name: str, system_prompt: str | None, model_name: str
) -> ConversationRecord:
    """The stored conversation ``name``, created if new; a given system prompt replaces the
    stored one (of the branch in view)."""
    record = store.find(name)
    if record is None:
        return store.create_conversation(name, system_prompt, model_name)
    if system_prompt is not None and system_prompt != record.system_prompt:
        store.set_system_prompt(record.id, system_prompt)
        return store.get(name)
    return record


class ConversationBase:
    """What a conversation is over any backend: its transcript (the truth), where its window
    starts for this model, and the lock that keeps a second process from answering in it."""

    def __init__(
        self,
        store: Store,
        states: StateStore,
        record: ConversationRecord,
        fingerprint: str,
        window_policy: WindowPolicy | None = None,
        wait_s: float = 0.0,
    ) -> None:
        """``wait_s``: how long to wait while another process answers in this conversation."""
        self.window_policy = window_policy or WindowPolicy()
        self.store = store
        self.states = states
        self.record = record
        self._lock = ConversationLock(states.directory, record.id, record.name, wait_s)
        self.closed = False
        self.fingerprint = fingerprint
        self.exchanges = self._load_exchanges()
        self.window_first = self._recorded_window_start()
        # The branch in view changed since the last turn (an edit, a regenerate, a switch):
        # the cache holds another branch and is cut back to where the two agree.
        self.branched = False
        # Where the branch in view ended (and its system prompt) before a branch began that
        # has no reply yet: a send that fails puts it back.
        self._head_before: tuple[int | None, str | None] | None = None

    def _recorded_window_start(self) -> int:
        """Where this model's window starts in the branch in view: the message recorded as
        its start when that message is on this branch, else the first (the next turn's plan
        moves it as far as the context needs)."""
        first_seq = self.store.window_start(self.record.id, self.fingerprint)
        return next((i for i, e in enumerate(self.exchanges) if e.record.seq == first_seq), 0)

    def _mark_branched(self) -> None:
        """The branch in view changed. A saved cache whose window was shifted in place (no
        record of its batches) cannot be cut back to the branch point exactly, in this
        process or a later one: it goes, and the next turn reads the branch again."""
        self.branched = True
        self.states.discard_unlisted(self.record.id, self.store.model_fingerprints(self.record.id))

    def _remember_head(self) -> None:
        if self._head_before is None:
            self._head_before = (self.store.head(self.record.id), self.record.system_prompt)

    def close(self) -> None:
        self.closed = True
        self._lock.release()

    # -- what a cache kept here adds (a local model); a server keeps its own --------------
    reads_ahead = False  # the message being typed is evaluated before it is sent

    def restore_now(self) -> RestoreReport | None:
        """The saved cache into memory now (None: there is none to restore here)."""
        return None

    def on_save_error(self, report: Callable[[str], None]) -> None:
        """Where a failed background save of the cache is reported."""

    def wait_saved(self) -> None:
        """Until the last background save of the cache is written."""

    def context_tokens(self, turn: ConversationTurn | None = None) -> int:
        """Tokens the context holds now (a server's: the last turn's prompt and reply)."""
        if turn is None:
            return 0
        return turn.stats.prompt_tokens + turn.stats.generated_tokens

    def read_ahead(self, draft: str, max_tokens: int, stop: Callable[[], bool]) -> ReadAheadResult:
        """Evaluate the message being typed (only where ``reads_ahead``)."""
        return ReadAheadResult(0)

    # -- transcript ----------------------------------------------------------------------
    def _load_exchanges(self) -> list[Exchange]:
        records = self.store.messages(self.record.id)
        return [Exchange(r, ChatMessage(r.role, r.content)) for r in records]

    def system_messages(self) -> list[ChatMessage]:
        if not self.record.system_prompt:
            return []
        return [ChatMessage("system", self.record.system_prompt)]

    def window_messages(self, first: int | None = None) -> list[ChatMessage]:
        """What the model sees: the system prompt, the pinned messages before ``first``
        (default: the window's start), and the messages from there."""
        first = self.window_first if first is None else first
        pinned = [e.prompt for e in self._pinned_before(first)]
        return self.system_messages() + pinned + [e.prompt for e in self.exchanges[first:]]

    def head_count(self, first: int | None = None) -> int:
        """Messages at the window's head that never leave it: the system prompt and the
        pinned messages before ``first``."""
        first = self.window_first if first is None else first
        return len(self.system_messages()) + len(self._pinned_before(first))

    def _pinned_before(self, first: int) -> list[Exchange]:
        return [e for e in self.exchanges[:first] if e.record.pinned]

    def pinned_flags(self, n: int) -> list[bool]:
        """For the window's ``n`` messages (from its start; a draft after them): pinned?"""
        flags = [e.record.pinned for e in self.exchanges[self.window_first :]]
        return (flags + [False] * n)[:n]

    def sees(self, index: int) -> bool:
        """Whether the model still sees message ``index`` (in the window, or pinned)."""
        return index >= self.window_first or self.exchanges[index].record.pinned

    def pin(self, index: int, pinned: bool = True) -> None:
        """Keep message ``index`` and the other half of its exchange (a question and its
        reply: templates want them in turn) in the context window however long the
        conversation grows, or let them leave again. Before the window's start, that changes
        what the model sees there: the next turn reads from it (exactly, as after an edit)."""
        role = self.exchanges[index].record.role
        partner = index + 1 if role == "user" else index - 1
        indexes = [index]
        if 0 <= partner < len(self.exchanges) and self.exchanges[partner].record.role != role:
            indexes.append(partner)
        for i in indexes:
            record = self.exchanges[i].record
            self.store.set_pinned(record.id, pinned)
            record.pinned = pinned
        if min(indexes) < self.window_first:
            self._mark_branched()

    def _commit_user(self, text: str) -> Exchange:
        """The user's message, in the transcript before anything can fail."""
        record = self.store.add_message(self.record.id, "user", text)
        user = Exchange(record, ChatMessage("user", text))
        self.exchanges.append(user)
        return user

    def _take_back_user(self, user: Exchange, window_before: int) -> bool:
        """The turn never started: the message is handed back to the caller (not kept twice)
        and the window is where it was. True if the window had moved."""
        self.exchanges.remove(user)
        self.store.delete_message(user.record)
        moved = self.window_first != window_before
        self.window_first = window_before
        if self._head_before is not None:  # the branch it was to start: back as it was
            head, system_prompt = self._head_before
            self._head_before = None
            if system_prompt != self.record.system_prompt:
                self.store.update_conversation(self.record.id, system_prompt=system_prompt)
                self.record = self.store.get(self.record.name)
            self.store.set_head(self.record.id, head)
            self.exchanges = self._load_exchanges()
            self.window_first = self._recorded_window_start()
        return moved

    def _store_reply(self, reply: Reply, stats: dict[str, Any], model_name: str) -> Exchange:
        """Commit the reply (partial if it did not end by itself) and where the window is."""
        status = "complete" if reply.stats.stop_reason in ("eos", "length", "stop") else "partial"
        record = self.store.add_message(
            self.record.id,
            "assistant",
            reply.text,
            status=status,
            stats=stats,
            tokens=reply.tokens,
            model_fingerprint=self.fingerprint,
        )
        self.store.update_conversation(self.record.id, model=model_name)
        self._head_before = None  # the new branch has its reply: it stays
        exchange = Exchange(record, ChatMessage("assistant", reply.text))
        self.exchanges.append(exchange)
        return exchange

    def _record_window_start(self) -> None:
        if self.window_first < len(self.exchanges):
            first_seq = self.exchanges[self.window_first].record.seq
            self.store.set_window_start(self.record.id, self.fingerprint, first_seq)

    def send(
        self,
        text: str,
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        fresh: bool = False,
        entered_at: float | None = None,
    ) -> ConversationTurn:
        """Commit the user's message and start the reply (each backend prepares its own).
        ``entered_at``: when the user sent it (``time.perf_counter``), if before this call."""
        raise NotImplementedError

    def _finish(self, turn: ConversationTurn) -> Exchange:
        """Commit the reply when the turn's iteration ends, however it ends."""
        raise NotImplementedError

    @staticmethod
    def _window_notices(window: WindowReport) -> list[str]:
        notices = []
        if window.dropped_messages:
            pinned = f"; {window.kept_pinned} pinned stay in it" if window.kept_pinned else ""
            notices.append(
                f"{window.dropped_messages} older messages ({window.dropped_tokens} tokens) left"
                f" the context window ({window.mode}); they stay in the transcript{pinned}"
            )
        if window.cut_tokens:
            notices.append(
                f"your message is longer than the context: its first {window.cut_tokens} tokens"
                " were left out (the full text is in the transcript)"
            )
        return notices

    def take_back_last_exchange(self) -> str | None:
        """Step back to before the last question (to answer it again); returns the question.
        The question and its reply stay, as a branch beside the one the next turn writes."""
        last_user = next(
            (
                i
                for i in range(len(self.exchanges) - 1, -1, -1)
                if self.exchanges[i].record.role == "user"
            ),
            None,
        )
        if last_user is None:
            return None
        text = self.exchanges[last_user].record.content
        self.branch_before(last_user)
        return text

    # -- branches ---------------------------------------------------------------------------
    def branch_before(self, index: int) -> None:
        """Put in view the branch up to (not including) message ``index``: the next message
        sent there starts a new branch beside the one that went on from it (an edit of that
        message, or a regenerate); nothing is deleted."""
        if not 0 <= index < len(self.exchanges):
            raise UsageError(
                f"there is no message {index + 1} (the branch has {len(self.exchanges)})"
            )
        self._remember_head()
        self.store.set_head(self.record.id, self.exchanges[index].record.parent_id)
        del self.exchanges[index:]
        self.window_first = min(self.window_first, index)
        self._mark_branched()

    def branches_at(self, index: int) -> tuple[int, int]:
        """(which, how many): message ``index``'s place among the branches that start there."""
        record = self.exchanges[index].record
        siblings = [m.id for m in self.store.siblings(record)]
        return siblings.index(record.id) + 1, len(siblings)

    def switch_branch(self, index: int, step: int) -> bool:
        """Put in view the branch ``step`` places from the one message ``index`` is on (its
        most recent continuation); False where there is no such branch."""
        record = self.exchanges[index].record
        siblings = self.store.siblings(record)
        place = [m.id for m in siblings].index(record.id) + step
        if not 0 <= place < len(siblings):
            return False
        self._show_branch_of(siblings[place].id)
        return True

    def hidden_branches(self) -> bool:
        """Whether the branch in view is empty (a new system prompt, nothing sent under it
        yet) while other branches hold messages."""
        return not self.exchanges and bool(self.store.all_messages(self.record.id))

    def show_latest_branch(self) -> None:
        """Put in view the branch written last (from an empty one)."""
        messages = self.store.all_messages(self.record.id)
        if messages:
            self._show_branch_of(messages[-1].id)

    def _show_branch_of(self, message_id: int) -> None:
        self._head_before = None
        self.store.set_head(self.record.id, self.store.latest_leaf(message_id))
        self.exchanges = self._load_exchanges()
        self.window_first = self._recorded_window_start()
        self._mark_branched()
        root = self.exchanges[0].record if self.exchanges else None
        if root is not None and root.system_prompt != self.record.system_prompt:
            # The conversation's system prompt is the branch in view's.
            self.store.update_conversation(self.record.id, system_prompt=root.system_prompt)
            self.record = self.store.get(self.record.name)

    def set_system_prompt(self, text: str | None) -> None:
        """A new system prompt for the branch in view, in place: the next turn reads it all
        again (the cache's head changed). ``branch_system_prompt`` keeps the old one."""
        self.store.set_system_prompt(self.record.id, text or None)
        self.record = self.store.get(self.record.name)
        if self.exchanges:
            self.exchanges[0].record.system_prompt = self.record.system_prompt
        self._mark_branched()

    def branch_system_prompt(self, text: str | None) -> None:
        """A new system prompt as a new branch: the conversation starts again under it from
        its first message, and the branch written under the old one stays beside it."""
        self._remember_head()
        self.store.update_conversation(self.record.id, system_prompt=text or None)
        self.store.set_head(self.record.id, None)
        self.record = self.store.get(self.record.name)
        self.exchanges = []
        self.window_first = 0
        self._mark_branched()


class Conversation(ConversationBase):
    """A stored conversation bound to a model loaded here, whose KV cache it saves."""

    def __init__(
        self,
        store: Store,
        states: StateStore,
        record: ConversationRecord,
        engine: Engine,
        saver: BackgroundSaver | None = None,
        window_mode: str = "auto",
        window_policy: WindowPolicy | None = None,
        wait_s: float = 0.0,
        prefix_min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        """``prefix_min_tokens``: a system prompt this long is saved as a shared prefix state
        (0: never)."""
        resolve_mode(window_mode, True)  # rejects an unknown mode before anything opens
        super().__init__(store, states, record, engine.fingerprint, window_policy, wait_s)
        self.window_mode = window_mode
        self.engine = engine
        self.saver = saver or BackgroundSaver(states)
        self._owns_saver = saver is None
        self.key = engine.state_key
        # A template that writes today's date writes the conversation's first day, so the
        # history reads the same (and its saved cache stays valid) on any later day.
        self.builder = engine.prompt_builder(datetime.fromtimestamp(record.created_at))
        # A saved state read to learn what the cache holds, kept for the restore.
        self._loaded: tuple[SavedState | StateRejected, float] | None = None
        self.prefix_min_tokens = prefix_min_tokens
        self._prefix_spans: list[int] = []  # where this turn's shared prefixes end
        self._ahead: _ReadAhead | None = None  # a message read ahead while being typed

    @classmethod
    def open(
        cls,
        store: Store,
        states: StateStore,
        name: str,
        engine: Engine,
        system_prompt: str | None = None,
        saver: BackgroundSaver | None = None,
        window_mode: str = "auto",
        wait_s: float = 0.0,
        prefix_min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> Conversation:
        """Open ``name``, creating it if new; a given system prompt replaces the stored one."""
        record = open_record(store, name, system_prompt, engine.model_name)
        return cls(
            store,
            states,
            record,
            engine,
            saver,
            window_mode,
            wait_s=wait_s,
            prefix_min_tokens=prefix_min_tokens,
        )

    def close(self) -> None:
        if self._owns_saver:
            self.saver.close()
        super().close()

    def _held_tokens(self, fresh: bool) -> list[int]:
        """What this conversation's cache holds as evaluated: the warm cache, else the saved
        state (kept for the restore that follows), else the record a replay rebuilds from."""
        self._loaded = None
        if self.engine.cache_owner == self.record.id and not fresh:
            # Tokens read ahead of a message being typed are no history: they count for
            # the prompt only where they are its exact ids (llama.cpp's prefix reuse).
            return self.engine.cached_tokens[: self.engine.committed]
        if not fresh:
            self._loaded = self._load_state()
        if self._loaded is not None and isinstance(self._loaded[0], SavedState):
            return list(self._loaded[0].tokens)
        record = self.store.eval_batches(self.record.id, self.fingerprint)
        return record[0] if record is not None else []

    reads_ahead = True

    def on_save_error(self, report: Callable[[str], None]) -> None:
        self.saver.on_error = report

    def wait_saved(self) -> None:
        self.saver.wait()

    def context_tokens(self, turn: ConversationTurn | None = None) -> int:
        return len(self.engine.cached_tokens)

    def restore_now(self) -> RestoreReport:
        """Restore the saved state into the model at once (the app does it when it opens a
        conversation, on the compute thread), so the first turn costs what a warm one does.
        Nothing happens without a valid state; the turn then restores or re-reads as ever."""
        engine = self.engine
        if engine.cache_owner == self.record.id and engine.cached_tokens:
            return RestoreReport()
        loaded, load_seconds = self._load_state()
        if not isinstance(loaded, SavedState) or len(loaded.tokens) >= engine.n_ctx:
            return RestoreReport()
        start = time.perf_counter()
        starts = self._batch_starts_of(list(loaded.tokens))
        if not engine.load_sequence_state(loaded.payload, loaded.tokens, starts):
            return RestoreReport()
        engine.cache_owner = self.record.id
        seconds = load_seconds + time.perf_counter() - start
        return RestoreReport(True, len(loaded.tokens), seconds)

    def _load_state(self) -> tuple[SavedState | StateRejected, float]:
        """The saved state (or why there is none) and the seconds reading it took."""
        start = time.perf_counter()
        try:
            loaded: SavedState | StateRejected = self.states.load(self.record.id, self.key)
        except StateRejected as exc:
            loaded = exc
        return loaded, time.perf_counter() - start

    # -- a turn ----------------------------------------------------------------------------
    def send(
        self,
        text: str,
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        fresh: bool = False,
        entered_at: float | None = None,
    ) -> ConversationTurn:
        """Commit the user's message, prepare the cache (what was read ahead while it was
        typed is kept where it is the prompt's), and start the reply."""
        started = time.perf_counter()
        user = self._commit_user(text)
        window_before = self.window_first
        ahead, self._ahead = self._ahead, None
        engine = self.engine
        try:
            messages = self.window_messages()
            held = self._held_tokens(fresh)
            prompt = self.builder.build(messages, held)
            if self.branched:  # the cache holds another branch: what is cut is not re-read
                prompt.discarded, prompt.discarded_reason = 0, None
            n_system = len(self.system_messages())
            self._prefix_spans = prefix_spans(self.builder, messages, prompt, n_system)
            plan = self._plan(prompt, messages, max_tokens)
            if not (plan.moved or plan.cut_tokens):
                window = WindowReport()
                restore = self._prepare_cache(prompt.tokens, fresh)
                if engine.cache_owner == self.record.id:
                    restore = self._with_read_ahead(restore, ahead, prompt.tokens)
            else:
                if engine.cache_owner == self.record.id:  # what was read ahead goes
                    engine.hold(engine.cached_tokens[: engine.committed])
                messages, prompt, window, restore = self._move_window(prompt, plan, fresh, held)
            generation = self.engine.generate(prompt.tokens, sampling, max_tokens, cancel)
            self.branched = False
        except BaseException:
            self._loaded = None
            # A cache the window move shifted no longer holds what the transcript says: it is
            # dropped (the saved state still holds the last turn, so the next one restores it).
            if self._take_back_user(user, window_before):
                self.engine.reset()
            raise
        turn = ConversationTurn(self, user, prompt, generation, restore, started, window, messages)
        turn.entered_at = started if entered_at is None else entered_at
        turn.notices.extend(self._window_notices(window))
        if restore.notice:
            turn.notices.append(restore.notice)
        return turn

    # -- reading a message ahead while it is typed ----------------------------------------
    def read_ahead(self, draft: str, max_tokens: int, stop: Callable[[], bool]) -> ReadAheadResult:
        """Evaluate what a message being typed settles into (on the compute thread), so its
        ``send`` evaluates only the rest: the template's header for it and its text but the
        last word, in small steps, until done or ``stop()`` says to give way. An edit falls
        back to the longest common prefix; a message that would move the window waits for
        ``send``, and so does a cut the cache cannot make exactly. The tokens read are the
        cache's past ``Engine.committed``: they count for the prompt ``send`` builds only
        where they are its exact ids, so that prompt is the one it would be without this."""
        engine = self.engine
        if self.closed or not draft.strip():
            return ReadAheadResult(0)
        last = self.exchanges[-1].record.id if self.exchanges else None
        settled_key = (
            draft[: settled_chars(draft)],
            self.record.system_prompt,
            last,
            self.window_first,
        )
        messages = [*self.window_messages(), ChatMessage("user", draft)]
        if engine.cache_owner != self.record.id:
            self._ahead = None
            try:
                self._ahead = self._start_reading(messages, max_tokens, stop)
            except ReplayStopped:
                return ReadAheadResult(0, finished=False)
            if self._ahead is None:
                return ReadAheadResult(0)
        if self._ahead is None:
            self._ahead = _ReadAhead()
        ahead = self._ahead
        if ahead.settled == settled_key:
            return ReadAheadResult(self._ahead_tokens())
        committed = engine.committed
        prompt, settled = self.builder.build_draft(messages, engine.cached_tokens[:committed])
        plan = self._plan(prompt, messages, max_tokens)
        if plan.moved or plan.cut_tokens:
            return ReadAheadResult(self._ahead_tokens())
        target = prompt.tokens[:settled]
        cached = engine.cached_tokens
        keep = common_prefix(cached, target)
        if keep < len(target) and keep < len(cached):  # an edit: back to what still agrees
            exact = keep >= committed or self._cut_is_exact(keep, committed, engine.batch_starts)
            if not (exact and engine.keeps(keep)):
                return ReadAheadResult(self._ahead_tokens())  # the turn makes that cut
            engine.hold(target[:keep])
            if engine.cached_tokens != target[:keep]:
                return ReadAheadResult(self._ahead_tokens())
        for start in range(keep, len(target), READ_AHEAD_BATCH):
            if stop() or self.closed:
                return ReadAheadResult(self._ahead_tokens(), finished=False)
            engine.extend(target[start : start + READ_AHEAD_BATCH])
        ahead.settled = settled_key
        return ReadAheadResult(self._ahead_tokens())

    def _start_reading(
        self, messages: list[ChatMessage], max_tokens: int, stop: Callable[[], bool]
    ) -> _ReadAhead | None:
        """Make the cache this conversation's before reading ahead: its saved state restored,
        or for a new conversation its known system prompt (or nothing: read from its first
        token). None where only the turn can rebuild it (a history without a usable state:
        the turn replays its recorded batches and says why)."""
        report = self.restore_now()
        if report.restored:
            return _ReadAhead(replace(report, seconds=0.0))
        if self.exchanges:
            return None
        engine = self.engine
        engine.reset()
        prompt = self.builder.build(messages)
        if self._plan(prompt, messages, max_tokens).moved:
            return None
        spans = prefix_spans(self.builder, messages, prompt, len(self.system_messages()))
        prefix = start_from_prefix(
            engine,
            self.states,
            self.key,
            prompt.tokens,
            spans,
            self.prefix_min_tokens,
            self.saver,
            stop,
        )
        engine.cache_owner = self.record.id
        return _ReadAhead(replace(RestoreReport.from_prefix(prefix), seconds=0.0))

    def _ahead_tokens(self) -> int:
        """Tokens the cache holds past the conversation (read ahead), if it is this one's."""
        engine = self.engine
        if engine.cache_owner != self.record.id:
            return 0
        return len(engine.cached_tokens) - engine.committed

    def _with_read_ahead(
        self, restore: RestoreReport, ahead: _ReadAhead | None, prompt: list[int]
    ) -> RestoreReport:
        """The turn's report with what was done while the message was typed: how the cache
        was prepared then (already paid for) and how many of the prompt's tokens were read."""
        engine = self.engine
        read = max(0, common_prefix(engine.cached_tokens, prompt) - engine.committed)
        before = restore
        if ahead is not None and ahead.report != RestoreReport():
            before = ahead.report
        if not read and before is restore:
            return restore
        return replace(before, read_ahead=read, notice=before.notice or restore.notice)

    # -- the context window ---------------------------------------------------------------
    def _plan(
        self, prompt: BuiltPrompt, messages: Sequence[ChatMessage], max_tokens: int
    ) -> WindowPlan:
        """Plan the window from the prompt's per-message spans (``messages``: what the prompt
        was built from, its head — system prompt, pinned messages — first)."""
        n_head = self.head_count()
        spans = prompt.spans[n_head:]
        head = spans[0][0] if spans else len(prompt.tokens)
        header = prompt.generation_header
        window = messages[n_head:]
        counts = [(m.role, end - start) for m, (start, end) in zip(window, spans, strict=True)]
        reserve = self.window_policy.reserve(self.engine.n_ctx, max_tokens)
        return plan_window(
            head,
            counts,
            0,
            self.engine.n_ctx,
            reserve,
            self.window_policy,
            header,
            self.pinned_flags(len(counts)),
        )

    def _move_window(
        self, old_prompt: BuiltPrompt, plan: WindowPlan, fresh: bool, old_held: list[int]
    ) -> tuple[list[ChatMessage], BuiltPrompt, WindowReport, RestoreReport]:
        """Move the window's start, cut an over-long newest message, and make the cache follow:
        shifted in place where that is safe, else re-evaluated from the text. ``old_held`` is
        what the cache held when ``old_prompt`` was built."""
        engine = self.engine
        new_first = self.window_first + plan.first
        messages = self.window_messages(new_first)
        if plan.cut_tokens:
            messages[-1] = self._cut_message(messages[-1], plan.cut_tokens)
        info = engine.info
        safe = shift_is_safe(info.architecture, info.sliding_window, engine.can_shift())
        # Pinned messages among those passed: what leaves is not one span to shift out.
        passed = self.exchanges[self.window_first : new_first]
        safe = safe and not any(e.record.pinned for e in passed)
        mode = resolve_mode(self.window_mode, safe) if plan.moved else "none"
        restore = RestoreReport()
        held: list[int] = []
        if mode == "shift" and not fresh:
            restore = self._prepare_cache(old_prompt.tokens, fresh=False)
            head = old_prompt.spans[self.head_count()][0]
            span = old_prompt.tokens[head : head + plan.dropped_tokens]
            if engine.cached_tokens[head : head + plan.dropped_tokens] == span:
                engine.drop_span(head, plan.dropped_tokens)
                held = engine.cached_tokens
            else:  # the cache does not hold the old window: nothing to shift
                mode = "exact"
        if mode == "exact" or (mode == "shift" and fresh):
            mode = "exact"
            engine.reset()
            self._loaded = None  # re-evaluated from the text: the saved state is not needed
        elif mode == "none":
            held = old_held
        prompt = self.builder.build(messages, held)
        if mode == "none":
            restore = self._prepare_cache(prompt.tokens, fresh)
        self.window_first = new_first
        kept = sum(1 for e in passed if e.record.pinned)
        report = WindowReport(
            mode, plan.dropped_messages, plan.dropped_tokens, plan.cut_tokens, kept
        )
        return messages, prompt, report, restore

    def _cut_message(self, message: ChatMessage, cut_tokens: int) -> ChatMessage:
        """The message without its first ``cut_tokens`` tokens (plus a margin for re-tokenizing)."""
        tokens = self.engine.tokenize(message.content)
        keep = max(1, len(tokens) - cut_tokens - CUT_MARGIN_TOKENS)
        return ChatMessage(message.role, self.engine.detokenize(tokens[-keep:]).lstrip())

    def _prepare_cache(self, prompt: list[int], fresh: bool) -> RestoreReport:
        """Restore the saved state, reuse the warm cache, or rebuild it from the transcript."""
        engine = self.engine
        if fresh:
            return self._replay(prompt, from_prefix=False)
        held = common_prefix(engine.cached_tokens, prompt)
        if engine.cache_owner == self.record.id and held > 0:
            if not self._cut_is_exact(held, engine.committed, engine.batch_starts):
                return self._replay(prompt)
            return RestoreReport()  # warm: this process's cache already holds the conversation
        loaded, load_seconds = self._loaded or self._load_state()
        self._loaded = None
        start = time.perf_counter() - load_seconds
        if isinstance(loaded, StateRejected):
            if str(loaded) == NO_STATE:
                return self._replay(prompt)
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt,
                f"saved KV cache dropped ({loaded}); re-evaluating the conversation",
            )
        state = loaded
        usable = common_prefix(state.tokens, prompt)
        if usable == 0:
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt,
                "saved KV cache dropped (it no longer matches the transcript); re-evaluating",
            )
        if usable <= held:
            return RestoreReport()
        starts = self._batch_starts_of(state.tokens)
        if not self._cut_is_exact(usable, len(state.tokens), starts):
            return self._replay(prompt)
        if not engine.load_sequence_state(state.payload, state.tokens, starts):
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt, "saved KV cache dropped (llama.cpp rejected it); re-evaluating"
            )
        engine.cache_owner = self.record.id
        return RestoreReport(True, usable, time.perf_counter() - start)

    def _cut_is_exact(self, keep: int, held: int, starts: list[int] | None) -> bool:
        """Whether cutting a cache of ``held`` tokens back to ``keep`` continues as a fresh
        evaluation would. Not after an edit or a branch switch into a cache whose window
        was shifted in place (its tokens saw messages that are gone): that prefix is
        evaluated again instead, from its recorded batches where they are known."""
        return not (self.branched and starts is None and keep < held)

    def _batch_starts_of(self, tokens: list[int]) -> list[int] | None:
        """How ``tokens`` were first evaluated, if the record covers them."""
        record = self.store.eval_batches(self.record.id, self.fingerprint)
        if record is None:
            return None
        recorded_tokens, starts = record
        if recorded_tokens[: len(tokens)] != tokens:
            return None
        return [s for s in starts if s < len(tokens)]

    def _replay(
        self,
        prompt: list[int],
        notice: str | None = None,
        from_prefix: bool = True,
    ) -> RestoreReport:
        """Rebuild the cache from the transcript in the batches that first built it.

        The recorded batches cover the tokens the cache held after the last turn; evaluated
        the same way they give the same bits, so the turn continues as if the cache had never
        been lost. Without a record (another model, an edited transcript) the whole prompt is
        simply evaluated by the turn.
        """
        start = time.perf_counter()
        self.engine.reset()
        record = self.store.eval_batches(self.record.id, self.fingerprint)
        if record is not None:
            tokens, starts = record
            shared = common_prefix(tokens, prompt)
            if shared == len(tokens) and shared < len(prompt):
                cut = shared
            else:  # stop at a batch boundary: a cut batch would not give the same bits
                cut = max((s for s in starts if s <= shared), default=0)
            batches = [s for s in starts if s < cut]
            if cut > 0 and self.engine.replay(prompt[:cut], batches):
                self.engine.cache_owner = self.record.id
                return RestoreReport(
                    tokens=0, seconds=time.perf_counter() - start, notice=notice, replayed=cut
                )
        if not from_prefix:
            return RestoreReport(notice=notice)
        # A new (or unrecorded) conversation: a known system prompt is restored.
        prefix = start_from_prefix(
            self.engine,
            self.states,
            self.key,
            prompt,
            self._prefix_spans,
            self.prefix_min_tokens,
            self.saver,
        )
        return RestoreReport.from_prefix(prefix, notice)

    def _finish(self, turn: ConversationTurn) -> Exchange:
        reply = self._store_reply(turn.generation, turn.stats_dict(), self.engine.model_name)
        self.engine.cache_owner = self.record.id
        try:
            self._record_cache_bookkeeping()
        except sqlite3.Error as exc:  # the reply is committed; only resume speed is at stake
            turn.notices.append(f"could not record how the cache was built ({exc})")
        self.save_state()
        return reply

    def _record_cache_bookkeeping(self) -> None:
        """How this model's cache was built and where its window starts, for the next open."""
        engine = self.engine
        self.store.set_eval_batches(
            self.record.id, self.fingerprint, engine.cached_tokens, engine.batch_starts
        )
        self._record_window_start()

    def save_state(self) -> None:
        """Snapshot the cache now (fast) and write it in the background."""
        tokens = self.engine.cached_tokens
        if not tokens:
            return
        state = SavedState(self.key, tokens, self.engine.save_sequence_state())
        self.saver.save(self.record.id, state)


def delete_conversation(store: Store, states: StateStore, name: str) -> str:
    """Delete a conversation, its messages and its saved states (refused while it is open)."""
    record = store.get(name)
    lock = ConversationLock(states.directory, record.id, record.name)
    try:
        store.delete_conversation(record.id)
        states.delete_conversation(record.id)
    finally:
        lock.release(remove=True)
    return record.name


def fork_conversation(
    store: Store, states: StateStore, name: str, at: int, new_name: str | None = None
) -> tuple[ConversationRecord, int]:
    """``localchat branch``: a new conversation holding the first ``at`` messages of ``name``'s
    branch in view (and its system prompt), whose first turn restores the shared part from
    the source's saved cache. Returns it and how many models' caches came along."""
    record = store.get(name)
    messages = store.messages(record.id)
    if not 0 <= at <= len(messages):
        raise UsageError(
            f"--at {at}: {record.name!r} has {len(messages)} messages; give 0 to {len(messages)}"
        )
    if at and messages[at - 1].role == "user":
        raise UsageError(
            f"--at {at}: message {at} is a question without its reply in the branch; branch"
            f" at {at - 1} (before it) or {at + 1} (after its reply)"
        )
    target = new_name or store.free_name(f"{record.name}-at-{at}")
    fork = store.fork_conversation(record, messages[:at], target)
    copied = sum(
        states.copy(record.id, fork.id, fingerprint)
        for fingerprint in store.model_fingerprints(record.id)
    )
    return fork, copied
