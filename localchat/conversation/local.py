"""One conversation on one model: a turn is store → restore → evaluate → stream → store → save.

The transcript (SQLite) is the truth; the saved KV state is a cache of it. Before a turn the
state is validated against the model, the context and the transcript's token ids, and only
what it does not hold is evaluated. After a turn the new state is saved in the background.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from localchat.backends.base import Sampling
from localchat.backends.llama.cache import ReplayStopped
from localchat.backends.llama.engine import Engine
from localchat.backends.llama.image_positions import batch_starts, image_start_before
from localchat.chat.images import image_at_after_cut
from localchat.chat.prompt import BuiltPrompt, common_prefix, settled_chars
from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolUse
from localchat.chat.window import WindowPlan, WindowPolicy, plan_window, resolve_mode, shift_is_safe
from localchat.conversation.base import ConversationBase, open_record
from localchat.conversation.prefix_states import (
    DEFAULT_MIN_TOKENS,
    prefix_spans,
    start_from_prefix,
)
from localchat.conversation.turn import (
    ConversationTurn,
    ReadAheadResult,
    ReplyStart,
    RestoreReport,
    WindowReport,
)
from localchat.errors import UsageError
from localchat.state.kvstate import BackgroundSaver, SavedState, StateRejected, StateStore
from localchat.state.store import ConversationRecord, Store

NO_STATE = "no saved state"
# Re-tokenizing a cut message can take a few more tokens than counted; leave this much room.
CUT_MARGIN_TOKENS = 8
# Tokens a message being typed is read ahead by at a time: Enter, or anything else asked of
# the compute thread, waits at most this many tokens' evaluation.
READ_AHEAD_BATCH = 16


@dataclass
class _ReadAhead:
    """A message being read ahead: how the cache was prepared for it (a restore, a known
    system prompt: already paid for when it is sent), and what the last full read covered.
    The tokens read are the cache's past ``KVCache.committed``."""

    report: RestoreReport = field(default_factory=RestoreReport)
    settled: tuple[str, str | None, int | None, int] | None = None


class Conversation(ConversationBase):
    """A stored conversation bound to a model loaded here, whose KV cache it saves."""

    backend: Engine

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
        super().__init__(store, states, record, engine, window_policy, wait_s)
        self.window_mode = window_mode
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

    def offer_tools(self, tool_use: ToolUse | None) -> None:
        super().offer_tools(tool_use)
        tools = list(self.tool_use.tools) if self.tool_use is not None else None
        self.builder = self.backend.prompt_builder(
            datetime.fromtimestamp(self.record.created_at), tools
        )

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
        if self.backend.cache.held_by(self.record.id) and not fresh:
            # Tokens read ahead of a message being typed are no history: they count for
            # the prompt only where they are its exact ids (llama.cpp's prefix reuse).
            return self.backend.cache.committed_tokens
        if not fresh:
            self._loaded = self._load_state()
        if self._loaded is not None and isinstance(self._loaded[0], SavedState):
            return list(self._loaded[0].tokens)
        record = self.store.eval_batches(self.record.id, self.fingerprint)
        return record[0] if record is not None else []

    reads_ahead = True

    def on_save_error(self, report: Callable[[str], None]) -> None:
        self.saver.on_error = report

    def wait_saved(self) -> str | None:
        self.saver.wait()
        return self.saver.last_error

    def context_tokens(self, turn: ConversationTurn | None = None) -> int:
        return len(self.backend.cache.cached_tokens)

    def restore_now(self) -> RestoreReport:
        """Restore the saved state into the model at once (the app does it when it opens a
        conversation, on the compute thread), so the first turn costs what a warm one does.
        Nothing happens without a valid state; the turn then restores or re-reads as ever."""
        engine = self.backend
        if engine.cache.held_by(self.record.id) and engine.cache.cached_tokens:
            return RestoreReport()
        loaded, load_seconds = self._load_state()
        if not isinstance(loaded, SavedState) or len(loaded.tokens) >= engine.n_ctx:
            return RestoreReport()
        start = time.perf_counter()
        starts = self._batch_starts_of(list(loaded.tokens))
        if not engine.cache.load_sequence_state(loaded.payload, loaded.tokens, starts):
            return RestoreReport()
        engine.cache.claim(self.record.id)
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
    def _start_reply(
        self,
        sampling: Sampling | None,
        max_tokens: int,
        cancel: threading.Event | None,
        fresh: bool,
    ) -> ReplyStart:
        """Prepare the cache (what was read ahead while the message was typed is kept where
        it is the prompt's; the window moves where the context needs it) and start the reply."""
        ahead, self._ahead = self._ahead, None
        engine = self.backend
        messages = self.window_messages()
        held = self._held_tokens(fresh)
        prompt = self.builder.build(messages, held)
        if self.branched:  # the cache holds another branch: what is cut is not re-read
            prompt.discarded, prompt.discarded_reason = 0, None
        n_system = len(self.system_messages())
        self._prefix_spans = prefix_spans(self.builder, messages, prompt, n_system)
        plan = self._plan(prompt, messages, max_tokens)
        encoded_before = _images_encoded(engine)
        if not (plan.moved or plan.cut_tokens):
            window = WindowReport()
            restore = self._prepare_cache(prompt.tokens, fresh)
            if engine.cache.held_by(self.record.id):
                restore = self._with_read_ahead(restore, ahead, prompt.tokens)
        else:
            if engine.cache.held_by(self.record.id):  # what was read ahead goes
                engine.cache.hold(engine.cache.committed_tokens)
            messages, prompt, window, restore = self._move_window(prompt, plan, fresh, held)
        encoded = _images_encoded(engine) - encoded_before  # a replay's
        restore = replace(restore, images_encoded=encoded) if encoded else restore
        generation = engine.generate(prompt.tokens, sampling, max_tokens, cancel, self.tool_use)
        self.branched = False
        return ReplyStart(prompt, generation, restore, window, messages)

    def _start_failed(self, window_moved: bool) -> None:
        """A cache the window move shifted no longer holds what the transcript says: it is
        dropped (the saved state still holds the last turn, so the next one restores it)."""
        self._loaded = None
        if window_moved:
            self.backend.cache.reset()

    # -- reading a message ahead while it is typed ----------------------------------------
    def read_ahead(self, draft: str, max_tokens: int, stop: Callable[[], bool]) -> ReadAheadResult:
        """Evaluate what a message being typed settles into (on the compute thread), so its
        ``send`` evaluates only the rest: the template's header for it and its text but the
        last word, in small steps, until done or ``stop()`` says to give way. An edit falls
        back to the longest common prefix; a message that would move the window waits for
        ``send``, and so does a cut the cache cannot make exactly. The tokens read are the
        cache's past ``KVCache.committed``: they count for the prompt ``send`` builds only
        where they are its exact ids, so that prompt is the one it would be without this."""
        engine = self.backend
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
        if not engine.cache.held_by(self.record.id):
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
        committed = engine.cache.committed
        prompt, settled = self.builder.build_draft(messages, engine.cache.cached_tokens[:committed])
        plan = self._plan(prompt, messages, max_tokens)
        if plan.moved or plan.cut_tokens:
            return ReadAheadResult(self._ahead_tokens())
        target = prompt.tokens[: image_start_before(prompt.tokens, settled)]  # no image cut
        cached = engine.cache.cached_tokens
        keep = common_prefix(cached, target)
        if keep < len(target) and keep < len(cached):  # an edit: back to what still agrees
            exact = keep >= committed or self._cut_is_exact(
                keep, committed, engine.cache.batch_starts
            )
            if not (exact and engine.cache.keeps(keep)):
                return ReadAheadResult(self._ahead_tokens())  # the turn makes that cut
            engine.cache.hold(target[:keep])
            if engine.cache.cached_tokens != target[:keep]:
                return ReadAheadResult(self._ahead_tokens())
        bounds = [*batch_starts(target, keep, len(target), READ_AHEAD_BATCH), len(target)]
        for start, end in itertools.pairwise(bounds):  # an image whole, in one
            if stop() or self.closed:
                return ReadAheadResult(self._ahead_tokens(), finished=False)
            engine.cache.extend(target[start:end])
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
        engine = self.backend
        engine.cache.reset()
        prompt = self.builder.build(messages)
        if self._plan(prompt, messages, max_tokens).moved:
            return None
        spans = prefix_spans(self.builder, messages, prompt, len(self.system_messages()))
        prefix = start_from_prefix(
            engine.cache,
            self.states,
            self.key,
            prompt.tokens,
            spans,
            self.prefix_min_tokens,
            self.saver,
            stop,
        )
        engine.cache.claim(self.record.id)
        return _ReadAhead(replace(RestoreReport.from_prefix(prefix), seconds=0.0))

    def _ahead_tokens(self) -> int:
        """Tokens the cache holds past the conversation (read ahead), if it is this one's."""
        engine = self.backend
        if not engine.cache.held_by(self.record.id):
            return 0
        return len(engine.cache.cached_tokens) - engine.cache.committed

    def _with_read_ahead(
        self, restore: RestoreReport, ahead: _ReadAhead | None, prompt: list[int]
    ) -> RestoreReport:
        """The turn's report with what was done while the message was typed: how the cache
        was prepared then (already paid for) and how many of the prompt's tokens were read."""
        engine = self.backend
        read = max(0, common_prefix(engine.cache.cached_tokens, prompt) - engine.cache.committed)
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
        reserve = self.window_policy.reserve(self.backend.n_ctx, max_tokens)
        return plan_window(
            head,
            counts,
            0,
            self.backend.n_ctx,
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
        engine = self.backend
        new_first = self.window_first + plan.first
        messages = self.window_messages(new_first)
        if plan.cut_tokens:
            messages[-1] = self._cut_message(messages[-1], plan.cut_tokens)
        info = engine.info
        safe = shift_is_safe(info.architecture, info.sliding_window, engine.cache.can_shift())
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
            if engine.cache.cached_tokens[head : head + plan.dropped_tokens] == span:
                engine.cache.drop_span(head, plan.dropped_tokens)
                held = engine.cache.cached_tokens
            else:  # the cache does not hold the old window: nothing to shift
                mode = "exact"
        if mode == "exact" or (mode == "shift" and fresh):
            mode = "exact"
            engine.cache.reset()
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
        """The message without its first ``cut_tokens`` tokens (plus a margin for
        re-tokenizing), cut from its text: its images stay, and where they alone do not fit
        the message is refused rather than sent without them."""
        tokens = self.backend.tokenize(message.content)
        keep = len(tokens) - cut_tokens - CUT_MARGIN_TOKENS
        if message.images and keep < 1:
            raise UsageError(
                f"this message's {len(message.images)} image(s) take more of the context"
                f" ({self.backend.n_ctx} tokens) than is left for them: start the model with"
                " a larger context (--ctx), or send fewer or smaller images"
            )
        text = self.backend.detokenize(tokens[-max(1, keep) :]).lstrip()
        at = image_at_after_cut(message.images, message.image_at, message.content, text)
        return replace(message, content=text, image_at=at)

    def _prepare_cache(self, prompt: list[int], fresh: bool) -> RestoreReport:
        """Restore the saved state, reuse the warm cache, or rebuild it from the transcript."""
        engine = self.backend
        if fresh:
            return self._replay(prompt, from_prefix=False)
        held = common_prefix(engine.cache.cached_tokens, prompt)
        if engine.cache.held_by(self.record.id) and held > 0:
            if not self._cut_is_exact(held, engine.cache.committed, engine.cache.batch_starts):
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
        if not engine.cache.load_sequence_state(state.payload, state.tokens, starts):
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt, "saved KV cache dropped (llama.cpp rejected it); re-evaluating"
            )
        engine.cache.claim(self.record.id)
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
        self.backend.cache.reset()
        record = self.store.eval_batches(self.record.id, self.fingerprint)
        if record is not None:
            tokens, starts = record
            shared = common_prefix(tokens, prompt)
            if shared == len(tokens) and shared < len(prompt):
                cut = shared
            else:  # stop at a batch boundary: a cut batch would not give the same bits
                cut = max((s for s in starts if s <= shared), default=0)
            batches = [s for s in starts if s < cut]
            if cut > 0 and self.backend.cache.replay(prompt[:cut], batches):
                self.backend.cache.claim(self.record.id)
                return RestoreReport(
                    tokens=0, seconds=time.perf_counter() - start, notice=notice, replayed=cut
                )
        if not from_prefix:
            return RestoreReport(notice=notice)
        # A new (or unrecorded) conversation: a known system prompt is restored.
        prefix = start_from_prefix(
            self.backend.cache,
            self.states,
            self.key,
            prompt,
            self._prefix_spans,
            self.prefix_min_tokens,
            self.saver,
        )
        return RestoreReport.from_prefix(prefix, notice)

    def _reply_committed(self, turn: ConversationTurn) -> None:
        """The cache is this conversation's: how it was built is recorded, and it is saved."""
        self.backend.cache.claim(self.record.id)
        try:
            self._record_cache_bookkeeping()
        except sqlite3.Error as exc:  # the reply is committed; only resume speed is at stake
            turn.notices.append(f"could not record how the cache was built ({exc})")
        self.save_state()

    def _record_cache_bookkeeping(self) -> None:
        """How this model's cache was built and where its window starts, for the next open."""
        engine = self.backend
        self.store.set_eval_batches(
            self.record.id, self.fingerprint, engine.cache.cached_tokens, engine.cache.batch_starts
        )
        self._record_window_start()

    def save_state(self) -> None:
        """Snapshot the cache now (fast) and write it in the background."""
        tokens = self.backend.cache.cached_tokens
        if not tokens:
            return
        state = SavedState(self.key, tokens, self.backend.cache.save_sequence_state())
        self.saver.save(self.record.id, state)


def _images_encoded(engine: Engine) -> int:
    """Images the engine's projector has encoded so far (0: it reads none)."""
    return 0 if engine.image_reader is None else engine.image_reader.encodes
