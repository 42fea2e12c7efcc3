"""Continuous batching: every running request advances in the same llama.cpp step.

A request waits for a free sequence (the one whose cache shares most of its prompt, else
the one idle longest), starts from the longest prefix found in memory or on disk, then each
step carries one token for every sequence that is generating and a chunk of the prompt of
every one that is reading — so a request that arrives while others stream starts at once
instead of waiting for their replies to end. An image in a prompt is decoded whole, alone,
as a step's first work (``_read_image``). Each sequence has its own sampler; a greedy
reply among others is the reply alone (per-sequence caches, see ``SequenceBatch``).

The loop runs on the compute thread while it has work and takes new requests between two
steps; the request's worker thread waits on its job. A request that arrives while the
sequences generate gives up the step in flight and is waited for (``PREPARE_WAIT_S``), so
that it joins the next step instead of one after it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from localchat.backends.compute_thread import compute_waiting, start_compute
from localchat.backends.llama.batch import (
    Chunk,
    SequenceBatch,
    StepInterrupted,
)
from localchat.backends.llama.draft_policy import Draft, DraftPolicy
from localchat.backends.llama.drafting import lookup_draft
from localchat.backends.llama.grammar import GrammarError
from localchat.backends.llama.image_positions import image_end, image_start_before, image_starts
from localchat.chat.prompt import common_prefix
from localchat.chat.stops import StopFilter
from localchat.chat.tool_stream import ToolCallStream
from localchat.errors import LocalchatError
from localchat.server.events import Finished, Logprob, TokenChoice
from localchat.server.prompt_cache import BLOCK, PromptCache
from localchat.server.requests import ApiError, GenerationRequest
from localchat.server.slots import HeldState, Job, Slot
from localchat.state.kvstate import SavedState

if TYPE_CHECKING:
    from localchat.backends.llama.image_reader import ImageReader

# A prefix another sequence holds is copied where it saves at least this many tokens: the
# copy takes the whole cache of one sequence (memory speed), a token's evaluation far more.
COPY_MIN_TOKENS = 16
# A request admitted while the sequences generate is made ready (its template rendered, its
# prompt tokenized) while the loop waits, this long at most, and joins the step after: the
# generating step in flight is given up for it (``SequenceBatch.interrupt``). Beside a
# step's llama.cpp threads its preparation took 2-4 times as long on 2 cores, and it then
# waited for the step in flight: a short request beside a stream had its first token after
# 35-47 ms, against 20-25 ms alone. The streams lose the step's part done, once a request.
PREPARE_WAIT_S = 0.05


class Scheduler:
    """The sequences of a ``SequenceBatch`` serving jobs; ``on_start``/``on_finish`` report
    to the runner's counters."""

    def __init__(
        self,
        batch: SequenceBatch,
        cache: PromptCache,
        on_start: Callable[[Job], None],
        on_finish: Callable[[Job], None],
    ) -> None:
        self.batch = batch
        self.engine = batch.engine
        self.cache = cache
        self.on_start = on_start
        self.on_finish = on_finish
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # a job came, or a preparation failed
        self._inbox: deque[Job] = deque()
        self._waiting: deque[Job] = deque()  # taken from the inbox, no sequence free yet
        self._looping = False
        self._preparing = 0  # admitted requests not yet handed in (``expect``)
        self._arrived = False  # one came since the loop last waited (it waits once for it)
        self._interruptible = False  # a generating step is in flight: it may be given up
        self._redo = False  # the step was given up once: the next runs whole
        self.interrupted_steps = 0  # given up for an arrival, since the start (/metrics)
        self._running: dict[int, Slot] = {}
        self._held: list[HeldState | None] = [None] * batch.n_seq
        self._last_used = [0.0] * batch.n_seq
        self._closing = False
        # Prompt lookup drafts where the engine drafts (exact where its kernels are): each
        # sequence's acceptance its own, what a step of n tokens costs shared by all.
        # (Not where a step's cells cannot be cut back exactly: a window cache, a recurrent
        # state.)
        self.drafting = self.engine.drafting and self.engine.cuts_back
        self._step_costs = DraftPolicy(max_step=batch.capacity)

    def expect(self) -> None:
        """A request is on its way (admitted, its prompt still to make; called on the event
        loop), to be handed to ``answer`` or given up with ``unexpect``: where a sequence
        is free for it, the generating step in flight stops and the loop waits for it."""
        with self._lock:
            self._preparing += 1
            self._arrived = True
            if self._interruptible and self._has_room(self._preparing - 1):
                self._interruptible = False
                self.batch.interrupt()

    def unexpect(self) -> None:
        """A request of ``expect`` that will not come (refused, or its client left)."""
        with self._lock:
            self._preparing -= 1
            self._queued.notify_all()

    def _has_room(self, ahead: int = 0) -> bool:
        """Whether a sequence is free for one more job after ``ahead`` others being made
        ready (with the lock held)."""
        taken = len(self._running) + len(self._waiting) + len(self._inbox) + ahead
        return taken < self.batch.n_seq

    @property
    def preparing(self) -> int:
        """Requests admitted whose prompt is still being made (``expect``)."""
        with self._lock:
            return self._preparing

    def answer(self, job: Job) -> Finished:
        """Queue ``job`` (one ``expect`` said would come) and wait for its reply (on the
        request's worker thread); how it ended."""
        with self._lock:
            self._preparing -= 1
            self._queued.notify_all()
            if self._closing:
                raise ApiError(503, "the server is stopping", "server_busy", "stopping")
            self._inbox.append(job)
            start = not self._looping
            self._looping = True
        if start:
            start_compute(self._loop)
        job.done.wait()
        if isinstance(job.error, GrammarError):  # what the request asked for
            raise ApiError(400, str(job.error), code="invalid_value")
        if isinstance(job.error, ApiError):  # an image this model cannot read
            raise job.error
        if isinstance(job.error, KeyboardInterrupt):  # Ctrl+C in the server's terminal
            raise ApiError(503, "the server was stopped (Ctrl+C) before the reply ended",
                           "server_busy", "stopping")  # fmt: skip
        if job.error is not None:  # one exception per request, not one shared by all
            error = job.error
            raise RuntimeError(f"{type(error).__name__}: {error}") from error
        return Finished(job.reason, job.stats, job.stop_sequence)

    def hold(self, states: list[tuple[str, SavedState]]) -> int:
        """Put saved states into the idle sequences, one each (on the compute thread, before
        any job): a request that continues one finds it in memory. How many went in."""
        assert not self._running and not self._looping
        held = 0
        for seq, (sid, state) in enumerate(states[: self.batch.n_seq]):
            if self.batch.load(seq, state.payload, state.tokens):
                self._held[seq] = HeldState(sid, list(state.tokens))
                held += 1
        return held

    @property
    def waiting(self) -> int:
        """Jobs handed in and not yet taken by the loop."""
        with self._lock:
            return len(self._inbox)

    def close(self) -> None:
        """Take no more jobs and stop those under way at their next step (their states are
        still saved); returns once the loop has let go of the compute thread."""
        with self._lock:
            self._closing = True
            self._queued.notify_all()  # the loop stops waiting for arrivals
            jobs = [*self._inbox, *self._waiting, *(r.job for r in list(self._running.values()))]
        for job in jobs:
            job.cancel.set()

    # -- the loop, on the compute thread -------------------------------------------------
    def _loop(self) -> None:
        waiting = self._waiting
        try:
            while True:
                with self._lock:
                    self._await_arrivals()
                    waiting.extend(self._inbox)
                    self._inbox.clear()
                    if not waiting and not self._running:
                        self._looping = False
                        return
                while len(self._running) < self.batch.n_seq:
                    job = next((j for j in waiting if self._startable(j)), None)
                    if job is None:
                        break
                    waiting.remove(job)
                    try:
                        self._start(job)
                    except Exception as exc:  # (a state that would not load): this one fails
                        self._fail(job, exc)
                if self._running:
                    self._step()
                    # Another model's loop, a load, an embedding: a step each, in turn, on
                    # one thread. Not once closing: the saves and the free queued behind
                    # this loop must find it ended.
                    if compute_waiting() and not self._closing:
                        start_compute(self._loop)
                        return
        except BaseException as exc:  # a failed step fails the requests, not the server
            with self._lock:
                waiting.extend(self._inbox)
                self._inbox.clear()
                self._looping = False
            for running in list(self._running.values()):
                self.batch.cut(running.seq, 0)
                self._held[running.seq] = None
                running.sampler.close()
                self._fail(running.job, exc)
            self._running.clear()
            for job in waiting:
                self._fail(job, exc)

    def _await_arrivals(self) -> None:
        """With the lock held, before a step of running sequences: where requests came since
        the last wait and a sequence is free for them, wait (``PREPARE_WAIT_S`` at most)
        until they are handed in, so that they join this step rather than a later one."""
        if not self._running or not self._arrived:
            return
        self._arrived = False
        if self._has_room():
            self._queued.wait_for(
                lambda: not self._preparing or self._inbox or self._closing, PREPARE_WAIT_S
            )

    @staticmethod
    def _startable(job: Job) -> bool:
        """Whether a job may take a sequence: one that shares another's prompt (a second
        choice of one request) waits until that one has read it, then copies its cells."""
        after = job.after
        return after is None or after.done.is_set() or after.stats.first_token_at is not None

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.error = exc
        try:
            self.on_finish(job)
        finally:
            job.done.set()

    def _start(self, job: Job) -> None:
        """Give ``job`` a sequence and the longest prefix of its prompt there is."""
        if job.cancel.is_set():  # its client left while it waited
            job.stats.stop_reason = "cancelled"
            self.on_finish(job)
            job.done.set()
            return
        batch, prompt = self.batch, job.prompt
        free = [s for s in range(batch.n_seq) if s not in self._running]
        seq = max(free, key=lambda s: (common_prefix(batch.tokens[s], prompt), -self._last_used[s]))
        self._take_prefix(job, seq)
        held, continues = self._held[seq], None
        if held is not None and held.continued_by(prompt):
            continues = held.sid  # this request extends that state: its own replaces it
        elif held is not None:
            self._held[seq] = None  # the sequence holds another conversation now
        job.image_starts = image_starts(prompt)
        request = job.request
        sampler = batch.sampler(
            request.sampling, request.frequency_penalty, request.presence_penalty, job.grammar,
            request.logit_bias,
        )  # fmt: skip
        stats = job.stats
        stats.prompt_tokens = len(prompt)
        stats.prompt_tokens_evaluated = len(prompt) - len(batch.tokens[seq])
        stats.stop_reason = "length"
        self._running[seq] = Slot(
            job, seq, self.engine.reply_text(prompt, job.spelled), StopFilter(job.request.stop), sampler,
            continues, time.perf_counter(), len(batch.tokens[seq]),
            policy=self._sequence_policy() if self.drafting else None,
            calls=self._calls_stream(request),
        )  # fmt: skip
        job.started = True
        self.on_start(job)

    def _take_prefix(self, job: Job, seq: int) -> None:
        """Make sequence ``seq`` hold the longest prefix of ``job``'s prompt there is: what
        it holds, a saved state (``job.hit``), or another sequence's cells, cut back to it."""
        batch, prompt = self.batch, job.prompt
        in_memory = common_prefix(batch.tokens[seq], prompt)
        hit = job.hit
        # A window cache cannot be cut back far: there only a state wholly inside the prompt.
        if (
            hit is not None
            and hit.shared >= in_memory + BLOCK
            and (not self.engine.windowed or hit.shared == len(hit.state.tokens))
        ):
            if batch.load(seq, hit.state.payload, hit.state.tokens):
                self._held[seq] = HeldState(hit.state_id, list(hit.state.tokens))
                job.restored = image_start_before(prompt, min(hit.shared, len(prompt) - 1))
            else:
                self._held[seq] = None
        job.hit = None  # its payload is in the cache now (or refused): not kept twice
        # Another sequence, running or idle, may hold more of the prompt (a system prompt
        # every client sends): its cache is copied rather than the prefix evaluated again.
        have = common_prefix(batch.tokens[seq], prompt)
        source = max(range(batch.n_seq), key=lambda s: common_prefix(batch.tokens[s], prompt))
        shared = common_prefix(batch.tokens[source], prompt)
        if source != seq and shared >= have + COPY_MIN_TOKENS:
            self._held[seq] = None
            job.restored = 0
            batch.copy(source, seq, image_start_before(prompt, min(shared, len(prompt) - 1)))
        # The last prompt token is always evaluated: its logits give the first reply token.
        # A cut never falls inside an image: the image is decoded again whole.
        keep = min(common_prefix(batch.tokens[seq], prompt), len(prompt) - 1)
        keep = image_start_before(prompt, keep)
        if not batch.cut(seq, keep):
            self._held[seq] = None
            job.restored = 0

    def _calls_stream(self, request: GenerationRequest) -> ToolCallStream | None:
        """Where the reply is read for calls: a stream that holds them back, in the model's
        format (the text before a call goes on as it comes)."""
        use = request.tool_use
        if not use.reads_calls:
            return None
        return ToolCallStream(self.engine.template.tool_family, use.names)

    def _sequence_policy(self) -> DraftPolicy:
        """A sequence's draft policy: its own acceptance, the scheduler's step costs."""
        costs = self._step_costs
        prior = self.engine.options.step_costs  # the calibration's, where it measured
        policy = DraftPolicy(step_s=costs.step_s, max_step=costs.max_step)
        if prior is not None:
            policy.prior_costs = dict(prior)
        return policy

    def _step(self) -> None:
        """One decode for every running sequence (a generating one's token, with a drafted
        run where one is worth verifying), then the tokens sampled for each that has read
        its whole prompt."""
        batch = self.batch
        self._read_image()
        chunks = []
        generating = [r for r in self._running.values() if r.next_token is not None]
        total = len(generating)
        for running in generating:
            assert running.next_token is not None
            running.draft = self._draft(running, total, batch.capacity - total)
            total += len(running.draft.tokens)
            tokens = [running.next_token, *running.draft.tokens]
            chunks.append(Chunk(running.seq, tokens, every=bool(running.draft.tokens)))
        room = batch.capacity - total
        reading = False
        for running in self._running.values():
            if running.next_token is not None:
                continue
            if running.job.cancel.is_set():
                continue
            prompt, held = running.job.prompt, len(batch.tokens[running.seq])
            take = min(room, batch.capacity - batch.n_seq, running.job.text_end(held) - held)
            if take <= 0:
                continue
            chunks.append(
                Chunk(running.seq, prompt[held : held + take], held + take == len(prompt))
            )
            room -= take
            reading = True
        started = time.perf_counter()
        try:
            rows = self._decode(chunks, interruptible=not reading)
        except StepInterrupted:  # a request came: the step is taken again with it
            for running in generating:
                running.draft = Draft([])
            return
        now = time.perf_counter()
        if self.drafting and chunks and not reading:  # what a step of this size costs
            self._step_costs.record_step(total, now - started)
        for running in list(self._running.values()):
            if running.job.cancel.is_set():
                self._finish(running, "cancelled")
            elif running.seq in rows:
                self._take(running, rows[running.seq], now)

    def _read_image(self) -> None:
        """Decode the image a reading sequence has next in its prompt, one a step (a step of
        its own: the others' tokens wait for it, not beside it); an image that cannot be
        read fails its request only."""
        for running in list(self._running.values()):
            job = running.job
            held = len(self.batch.tokens[running.seq])
            if running.next_token is not None or job.cancel.is_set() or held >= len(job.prompt):
                continue
            if job.prompt[held] >= 0:
                continue
            end = image_end(job.prompt, held)
            try:
                self.batch.decode_image(running.seq, job.prompt[held:end], self._reader())
            except Exception as exc:
                self._give_up(running, exc)
            return

    def _reader(self) -> ImageReader:
        reader = self.engine.image_reader
        if reader is None:  # the runner refuses such a prompt first
            raise ValueError(self.engine.images_refused() or "this model reads no images")
        return reader

    def _give_up(self, running: Slot, exc: BaseException) -> None:
        """End ``running``'s request with ``exc`` (a 400 where the image is the cause), the
        others running on."""
        del self._running[running.seq]
        self.batch.cut(running.seq, 0)
        self._held[running.seq] = None
        running.sampler.close()
        refused = isinstance(exc, ValueError | LocalchatError)
        error = ApiError(400, str(exc).split("\n")[0]) if refused else exc
        self._fail(running.job, error)

    def _decode(self, chunks: list[Chunk], interruptible: bool) -> dict[int, list[int]]:
        """``batch.decode``; an ``interruptible`` step (every sequence generating, none
        reading its prompt) may be given up for a request that arrives meanwhile (not where
        the caches cannot be cut back exactly, nor twice in a row)."""
        if not chunks:
            return {}
        interruptible = interruptible and not self._redo and self.engine.cuts_back
        self._redo = False
        if not interruptible:
            return self.batch.decode(chunks)
        with self._lock:
            self.batch.clear_interrupt()
            self._interruptible = True
        try:
            return self.batch.decode(chunks)
        except StepInterrupted:
            self._redo = True
            self.interrupted_steps += 1
            raise
        finally:
            with self._lock:
                self._interruptible = False
                self.batch.clear_interrupt()

    def _draft(self, running: Slot, base: int, spare: int) -> Draft:
        """The tokens that followed the latest earlier occurrence of the sequence's last few
        (its prompt and reply), as many as its acceptance makes worth verifying in a step
        of ``base`` other tokens (and the step has ``spare`` places left); none where
        drafting is off or does not pay."""
        policy = running.policy
        if policy is None or spare <= 0:
            return Draft([])
        job, reply = running.job, running.reply
        room = min(
            spare,
            job.max_tokens - reply.generated,
            self.batch.n_ctx_seq - len(job.prompt) - len(reply.tokens) - 1,
        )
        context = np.array([*job.prompt, *reply.tokens], dtype=np.intc)
        found = lookup_draft(context, room)
        length = policy.best_length(found.kind, len(found.tokens), base=base)[0]
        if not length:
            policy.idle_step()
            return Draft([])
        return Draft(found.tokens[:length], found.depth)

    def _take(self, running: Slot, rows: list[int], now: float) -> None:
        """Sample each row in turn: a drafted token is kept while the model samples it
        there; the first the model samples otherwise is its own, and ends the step's run.
        Drafted cells past what was kept leave the cache."""
        draft = running.draft.tokens
        accepted = 0
        for index, row in enumerate(rows):
            token = self.batch.sample(running.sampler, row)
            if running.job.request.logprobs is not None:
                self._logprob(running, row, token)
            self._advance(running, token, now)
            if running.seq not in self._running:  # it ended there (the cache is cut)
                break
            if index >= len(draft) or token != draft[index]:
                break
            accepted += 1
        if draft:
            stats, policy = running.job.stats, running.policy
            stats.drafted_tokens += min(len(draft), accepted + 1)  # those tried
            stats.accepted_tokens += accepted
            stats.draft_steps += 1
            if policy is not None:
                policy.record_verification(running.draft.kind, len(draft), accepted)
            if running.seq in self._running:  # the cache: prompt and reply, less the new token
                self.batch.cut(running.seq, len(running.job.prompt) + len(running.reply.tokens) - 1)
        running.draft = Draft([])

    def _logprob(self, running: Slot, row: int, token: int) -> None:
        """The sampled token's log probability and the alternatives asked for, sent on
        before its text (not for the token that ends the reply)."""
        if self.engine.is_end_of_generation(token):
            return
        top = running.job.request.logprobs or 0
        chosen, best = self.batch.logprobs(row, token, top)
        running.send(Logprob(self._choice(token, chosen), tuple(self._choice(*b) for b in best)))

    def _choice(self, token: int, logprob: float) -> TokenChoice:
        data = self.engine.token_bytes(token)
        return TokenChoice(data.decode("utf-8", errors="replace"), data, logprob)

    def _advance(self, running: Slot, token: int, now: float) -> None:
        """Take the token sampled for ``running``: stream it or end the reply."""
        stats, reply, job = running.job.stats, running.reply, running.job
        if not reply.generated:
            running.first_at = stats.first_token_at = now
            stats.ttft_s = now - running.started
            if stats.ttft_s > 0:
                stats.prompt_tps = stats.prompt_tokens_evaluated / stats.ttft_s
        if self.engine.is_end_of_generation(token):
            self._finish(running, "eos")
            return
        for delta in reply.feed(token):
            running.emit(delta.text, delta.reasoning)
        stats.generated_tokens = reply.generated
        if reply.generated > 1 and now > running.first_at:
            stats.gen_tps = (reply.generated - 1) / (now - running.first_at)
        if reply.stopped or running.request_stopped:
            self._finish(running, "stop")
        elif reply.generated >= job.max_tokens:
            self._finish(running, "length")
        elif len(job.prompt) + reply.generated >= self.batch.n_ctx_seq:
            self._finish(running, "context")
        else:
            running.next_token = token

    def _finish(self, running: Slot, reason: str) -> None:
        """End the reply: the rest of its text, the cache cut to the prompt and the reply
        kept, that state saved in the background, the waiting request released (whatever
        fails on the way fails this request only)."""
        del self._running[running.seq]
        job, reply = running.job, running.reply
        try:
            running.end(reason)
            reply.close()
            stats = job.stats
            held = len(self.batch.tokens[running.seq])
            if not reply.generated:  # stopped while it read the prompt: what it read
                stats.prompt_tokens_evaluated = max(0, min(held, len(job.prompt)) - running.reused)
            kept = len(job.prompt) + len(reply.tokens)
            if held > kept:
                self.batch.cut(running.seq, kept)
            self._last_used[running.seq] = time.monotonic()
            self._save(running)
        except Exception as exc:
            job.error = exc
        finally:
            running.sampler.close()
            self.on_finish(job)
            job.done.set()

    def _save(self, running: Slot) -> None:
        """Save what the sequence holds (the prompt and the reply) in the background."""
        seq = running.seq
        tokens = list(self.batch.tokens[seq])
        held = self._held[seq]
        if len(tokens) < BLOCK or (
            running.continues is not None
            and held is not None
            and len(tokens) < common_prefix(held.tokens, tokens) + BLOCK
        ):
            return  # short, or less than a block past the state it continues: not worth a write
        self._keep(seq, tokens, running.continues, len(running.job.prompt))

    def _keep(
        self, seq: int, tokens: list[int], replaces: str | None, prompt: int | None = None
    ) -> bool:
        """Save what ``seq`` holds (``tokens``, ``prompt`` of them sent by the request, the
        rest its reply) in the background, as the state it now holds (``replaces``: the saved
        state it extends); False when the save was skipped."""
        sid = self.cache.save(tokens, self.batch.save(seq), replaces)
        if sid is not None:
            self._held[seq] = HeldState(sid, tokens, len(tokens) if prompt is None else prompt)
        return sid is not None

    def save_unsaved(self) -> int:
        """At the server's stop, on the compute thread once the loop has let go of it: each
        sequence's tokens past its last saved state (a reply ends saved only a block past
        it), saved too, so a restarted server continues each conversation from all it held,
        not from its last whole block. Waits for the disk where it is behind. How many."""
        saved = 0
        for seq in range(self.batch.n_seq):
            tokens = list(self.batch.tokens[seq])
            held = self._held[seq]
            if len(tokens) < BLOCK or (held is not None and held.tokens[: len(tokens)] == tokens):
                continue  # short, or all of it in the saved state already
            replaces = held.sid if held is not None and held.continued_by(tokens) else None
            self.cache.saver.wait()  # room among the pending saves: none is skipped
            saved += self._keep(seq, tokens, replaces)
        return saved

    def rates(self) -> list[float]:
        """Each generating sequence's tokens/s so far (read from any thread)."""
        return [r.job.stats.gen_tps for r in list(self._running.values()) if r.job.stats.gen_tps]
