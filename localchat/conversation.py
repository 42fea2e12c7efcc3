"""One conversation on one model: a turn is store → restore → evaluate → stream → store → save.

The transcript (SQLite) is the truth; the saved KV state is a cache of it. Before a turn the
state is validated against the model, the context and the transcript's token ids, and only
what it does not hold is evaluated. After a turn the new state is saved in the background.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from localchat.engine import LLAMA_CPP_VERSION, Engine, Generation, Sampling, TokenDelta, TurnStats
from localchat.kvstate import BackgroundSaver, SavedState, StateKey, StateRejected, StateStore
from localchat.locks import ConversationLock
from localchat.prompt import BuiltPrompt, PromptMessage
from localchat.store import ConversationRecord, MessageRecord, Store

NO_STATE = "no saved state"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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


@dataclass
class Exchange:
    """A message as the conversation knows it: the stored record and its prompt form."""

    record: MessageRecord
    prompt: PromptMessage


@dataclass
class ConversationTurn:
    """A turn in progress; iterate for deltas. The reply is committed and the state saved when
    iteration ends, however it ends (finished, cancelled, interrupted)."""

    conversation: Conversation
    user: Exchange
    prompt: BuiltPrompt
    generation: Generation
    restore: RestoreReport
    started_at: float
    reply: Exchange | None = None
    notices: list[str] = field(default_factory=list)

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

    def stats_dict(self) -> dict[str, Any]:
        return turn_stats_dict(self.generation.stats, self.restore)


def turn_stats_dict(stats: TurnStats, restore: RestoreReport | None = None) -> dict[str, Any]:
    """A turn's figures as ``ask --json`` and the stored message report them."""
    restore = restore or RestoreReport()
    return {
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_evaluated": stats.prompt_tokens_evaluated + restore.replayed,
        "generated_tokens": stats.generated_tokens,
        "ttft_s": round(restore.seconds + stats.ttft_s, 6),
        "prompt_tps": round(stats.prompt_tps, 3),
        "gen_tps": round(stats.gen_tps, 3),
        "kv_bytes_used": stats.kv_bytes_used,
        "kv_bytes_allocated": stats.kv_bytes_allocated,
        "restored_from_state": restore.restored,
        "restored_tokens": restore.tokens,
        "restore_s": round(restore.seconds, 6),
        "window_dropped_messages": 0,
        "stop_reason": stats.stop_reason,
    }


class Conversation:
    """A stored conversation bound to a loaded model; holds the conversation's lock."""

    def __init__(
        self,
        store: Store,
        states: StateStore,
        record: ConversationRecord,
        engine: Engine,
        saver: BackgroundSaver | None = None,
    ) -> None:
        self.store = store
        self.states = states
        self.record = record
        self.engine = engine
        self._lock = ConversationLock(states.directory, record.id, record.name)
        self.saver = saver or BackgroundSaver(states)
        self._owns_saver = saver is None
        self.fingerprint = engine.fingerprint
        self.key = StateKey(
            self.fingerprint, engine.n_ctx, engine.options.kv_type, LLAMA_CPP_VERSION
        )
        self.builder = engine.prompt_builder()
        self.exchanges = self._load_exchanges()

    @classmethod
    def open(
        cls,
        store: Store,
        states: StateStore,
        name: str,
        engine: Engine,
        system_prompt: str | None = None,
        saver: BackgroundSaver | None = None,
    ) -> Conversation:
        """Open ``name``, creating it if new; a given system prompt replaces the stored one."""
        record = store.find(name)
        if record is None:
            record = store.create_conversation(name, system_prompt, engine.model_path.name)
        elif system_prompt is not None and system_prompt != record.system_prompt:
            store.update_conversation(record.id, system_prompt=system_prompt)
            record = store.get(name)
        return cls(store, states, record, engine, saver)

    def close(self) -> None:
        if self._owns_saver:
            self.saver.close()
        self._lock.release()

    # -- transcript ----------------------------------------------------------------------
    def _load_exchanges(self) -> list[Exchange]:
        records = self.store.messages(self.record.id)
        known = self.store.message_tokens(self.record.id, self.fingerprint)
        return [Exchange(r, PromptMessage(r.role, r.content, known.get(r.id))) for r in records]

    def prompt_messages(self) -> list[PromptMessage]:
        system = (
            [PromptMessage("system", self.record.system_prompt)]
            if self.record.system_prompt
            else []
        )
        return system + [e.prompt for e in self.exchanges]

    def _persist_new_tokens(self, before: dict[int, bool]) -> None:
        """Token ids computed for this model by the last build are stored for exact reuse."""
        for exchange in self.exchanges:
            if not before.get(exchange.record.id) and exchange.prompt.tokens is not None:
                self.store.set_message_tokens(
                    exchange.record.id, self.fingerprint, exchange.prompt.tokens
                )

    # -- a turn ----------------------------------------------------------------------------
    def send(
        self,
        text: str,
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        fresh: bool = False,
    ) -> ConversationTurn:
        """Commit the user's message, prepare the cache, and start the reply."""
        started = time.perf_counter()
        record = self.store.add_message(self.record.id, "user", text)
        user = Exchange(record, PromptMessage("user", text))
        self.exchanges.append(user)
        try:
            had_tokens = {e.record.id: e.prompt.tokens is not None for e in self.exchanges}
            prompt = self.builder.build(self.prompt_messages())
            self._persist_new_tokens(had_tokens)
            restore = self._prepare_cache(prompt.tokens, fresh)
            generation = self.engine.generate(prompt.tokens, sampling, max_tokens, cancel)
        except BaseException:
            # The turn never started: the message is handed back to the caller, not kept twice.
            self.exchanges.remove(user)
            self.store.delete_messages_from(self.record.id, record.seq)
            raise
        turn = ConversationTurn(self, user, prompt, generation, restore, started)
        if restore.notice:
            turn.notices.append(restore.notice)
        return turn

    def _prepare_cache(self, prompt: list[int], fresh: bool) -> RestoreReport:
        """Restore the saved state, reuse the warm cache, or rebuild it from the transcript."""
        engine = self.engine
        if fresh:
            return self._replay(prompt)
        held = common_prefix(engine.cached_tokens, prompt)
        if engine.cache_owner == self.record.id and held > 0:
            return RestoreReport()  # warm: this process's cache already holds the conversation
        start = time.perf_counter()
        try:
            state = self.states.load(self.record.id, self.key)
        except StateRejected as exc:
            if str(exc) == NO_STATE:
                return self._replay(prompt)
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt, f"saved KV cache dropped ({exc}); re-evaluating the conversation"
            )
        usable = common_prefix(state.tokens, prompt)
        if usable == 0:
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt,
                "saved KV cache dropped (it no longer matches the transcript); re-evaluating",
            )
        if usable <= held:
            return RestoreReport()
        if not engine.load_sequence_state(
            state.payload, state.tokens, self._batch_starts_of(state.tokens)
        ):
            self.states.discard(self.record.id, self.fingerprint)
            return self._replay(
                prompt, "saved KV cache dropped (llama.cpp rejected it); re-evaluating"
            )
        engine.cache_owner = self.record.id
        return RestoreReport(True, usable, time.perf_counter() - start)

    def _batch_starts_of(self, tokens: list[int]) -> list[int] | None:
        """How ``tokens`` were first evaluated, if the record covers them."""
        record = self.store.eval_batches(self.record.id, self.fingerprint)
        if record is None:
            return None
        recorded_tokens, starts = record
        if recorded_tokens[: len(tokens)] != tokens:
            return None
        return [s for s in starts if s < len(tokens)]

    def _replay(self, prompt: list[int], notice: str | None = None) -> RestoreReport:
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
            if cut > 0 and self.engine.replay(prompt[:cut], [s for s in starts if s < cut]):
                self.engine.cache_owner = self.record.id
                return RestoreReport(
                    tokens=0, seconds=time.perf_counter() - start, notice=notice, replayed=cut
                )
        return RestoreReport(notice=notice)

    def _finish(self, turn: ConversationTurn) -> Exchange:
        generation = turn.generation
        history = [*self.prompt_messages()]
        reply_prompt = PromptMessage("assistant", generation.text)
        reply_prompt.tokens = self.builder.reply_tokens(
            history, reply_prompt, generation.tokens, turn.prompt.generation_header
        )
        stats = turn.stats_dict()
        status = "complete" if generation.stats.stop_reason in ("eos", "length") else "partial"
        record = self.store.add_message(
            self.record.id,
            "assistant",
            generation.text,
            status=status,
            stats=stats,
            tokens=reply_prompt.tokens,
            model_fingerprint=self.fingerprint,
        )
        self.store.update_conversation(self.record.id, model=self.engine.model_path.name)
        reply = Exchange(record, reply_prompt)
        self.exchanges.append(reply)
        self.engine.cache_owner = self.record.id
        self.store.set_eval_batches(
            self.record.id, self.fingerprint, self.engine.cached_tokens, self.engine.batch_starts
        )
        self.save_state()
        return reply

    def save_state(self) -> None:
        """Snapshot the cache now (fast) and write it in the background."""
        tokens = self.engine.cached_tokens
        if not tokens:
            return
        state = SavedState(self.key, tokens, self.engine.save_sequence_state())
        self.saver.save(self.record.id, state)
