"""What a conversation is over any backend: its transcript and branches (the truth), its
context window for this model, and one ``send`` whose backend-specific steps are hooks.

Changes to the transcript (pins, branch switches, edits) run on the compute thread, where a
message being read ahead cannot see them half made.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from localchat.backends.base import Backend, Reply, Sampling
from localchat.backends.compute_thread import run_compute
from localchat.chat.template import ChatMessage, results_saying
from localchat.chat.tools import NOT_RUN, ToolUse
from localchat.chat.window import WindowPolicy
from localchat.conversation.turn import (
    ConversationTurn,
    Exchange,
    ReadAheadResult,
    ReplyStart,
    RestoreReport,
)
from localchat.errors import UsageError
from localchat.state.kvstate import StateStore
from localchat.state.locks import ConversationLock
from localchat.state.store import ConversationRecord, Store

P = ParamSpec("P")
T = TypeVar("T")
C = TypeVar("C", bound="ConversationBase")


def on_compute_thread(
    method: Callable[Concatenate[C, P], T],
) -> Callable[Concatenate[C, P], T]:
    """A change to the transcript runs on the compute thread: between two steps of reading a
    message ahead (which gives way to it), never in the middle of one."""

    @functools.wraps(method)
    def run_there(self: C, *args: P.args, **kwargs: P.kwargs) -> T:
        return run_compute(method, self, *args, **kwargs)

    return run_there


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
        backend: Backend,
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
        self.backend = backend
        self.fingerprint = backend.fingerprint
        self.exchanges = self._load_exchanges()
        self.window_first = self._recorded_window_start()
        # The branch in view changed since the last turn (an edit, a regenerate, a switch):
        # the cache holds another branch and is cut back to where the two agree.
        self.branched = False
        # Where the branch in view ended (and its system prompt) before a branch began that
        # has no reply yet: a send that fails puts it back.
        self._head_before: tuple[int | None, str | None] | None = None
        # The tools its replies are offered (they render at the prompt's head).
        self.tool_use: ToolUse | None = None

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

    def offer_tools(self, tool_use: ToolUse | None) -> None:
        """The tools the next replies are offered. They render at the prompt's head: a
        different set makes the model read the conversation again."""
        self.tool_use = tool_use if tool_use is not None and tool_use.tools else None

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

    def wait_saved(self) -> str | None:
        """Until the last background save of the cache is written; why the last save
        failed, if one did (the transcript is safe either way)."""
        return None

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
        return [Exchange(r, r.chat_message) for r in records]

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

    def sees(self, message_id: int) -> bool:
        """Whether the model still sees a message (in the window, or pinned)."""
        index = self.index_of(message_id)
        return index >= self.window_first or self.exchanges[index].record.pinned

    def index_of(self, message_id: int) -> int:
        """Where message ``message_id`` is in the branch in view."""
        for index, exchange in enumerate(self.exchanges):
            if exchange.record.id == message_id:
                return index
        raise UsageError(f"message {message_id} is not in the branch in view")

    @on_compute_thread
    def pin(self, message_id: int, pinned: bool = True) -> None:
        """Keep a message and the other half of its exchange (a question and its reply:
        templates want them in turn) in the context window however long the conversation
        grows, or let them leave again. Before the window's start, that changes what the
        model sees there: the next turn reads from it (exactly, as after an edit)."""
        index = self.index_of(message_id)
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

    def _commit(self, messages: list[ChatMessage]) -> list[Exchange]:
        """The user's message (or the results of the calls the last reply made), in the
        transcript before anything can fail."""
        committed = []
        for message in messages:
            record = self.store.add_message(
                self.record.id,
                message.role,
                message.content,
                tool_call_id=message.tool_call_id,
                images=message.images,
            )
            committed.append(Exchange(record, record.chat_message))
        self.exchanges.extend(committed)
        return committed

    def _take_back(self, committed: list[Exchange], window_before: int) -> bool:
        """The turn never started: the messages are handed back to the caller (not kept
        twice) and the window is where it was. True if the window had moved."""
        for exchange in reversed(committed):
            self.exchanges.remove(exchange)
            self.store.delete_message(exchange.record)
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
            tool_calls=reply.tool_calls,
        )
        self.store.update_conversation(self.record.id, model=model_name)
        self._head_before = None  # the new branch has its reply: it stays
        exchange = Exchange(record, record.chat_message)
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
        images: tuple[str, ...] = (),
    ) -> ConversationTurn:
        """Commit the user's message, then start the reply the backend's way; a reply that
        cannot start hands the message back and leaves the conversation as it was.
        ``entered_at``: when the user sent it (``time.perf_counter``), if before this call;
        ``fresh``: rebuild a cache kept here from the transcript (a server keeps its own);
        ``images``: the keys of the images it shows (kept in the data folder's store), refused
        before anything is stored where the backend reads none."""
        if images and (refused := self.backend.images_refused()):
            raise UsageError(refused)
        self._answer_unanswered_calls()
        message = ChatMessage("user", text, images=images)
        return self._turn([message], sampling, max_tokens, cancel, fresh, entered_at)

    def send_results(
        self,
        results: list[ChatMessage],
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
    ) -> ConversationTurn:
        """Commit the results of the calls the last reply made (``tool`` messages, one per
        call, in its order), then start the reply that reads them: the cache holds the
        conversation up to the calls, so only the results and the cue are evaluated."""
        self._check_answers(results)
        if self.tool_use is not None and self.tool_use.forced:
            self.offer_tools(self.tool_use.after_call())
        # The results stay even where the reply cannot start: the calls are answered.
        return self._turn(results, sampling, max_tokens, cancel, False, None, keep=True)

    def record_results(self, results: list[ChatMessage]) -> None:
        """Commit results with no reply after them (calls the user did not allow: the next
        message goes on from there, the model told what became of its calls)."""
        self._check_answers(results)
        self._commit(results)

    def _answer_unanswered_calls(self) -> None:
        """Calls the branch ends on without results (a reply stopped on its way to them,
        a fork made there) get one saying so: every template and server wants each call
        answered before the next message."""
        calls = self.exchanges[-1].record.tool_calls if self.exchanges else ()
        if calls:
            self._commit(results_saying(calls, NOT_RUN))

    def _check_answers(self, results: list[ChatMessage]) -> None:
        calls = self.exchanges[-1].record.tool_calls if self.exchanges else ()
        answered = [m.tool_call_id for m in results]
        if not calls or answered != [call.id for call in calls]:
            raise UsageError("results must answer the calls of the conversation's last reply")

    def _turn(
        self,
        messages: list[ChatMessage],
        sampling: Sampling | None,
        max_tokens: int,
        cancel: threading.Event | None,
        fresh: bool,
        entered_at: float | None,
        keep: bool = False,
    ) -> ConversationTurn:
        """Commit ``messages`` and start the reply; one that cannot start takes them back
        (unless ``keep``: results stay, answering their calls)."""
        started = time.perf_counter()
        committed = self._commit(messages)
        window_before = self.window_first
        try:
            start = self._start_reply(sampling, max_tokens, cancel, fresh)
        except BaseException:
            if keep:
                moved, self.window_first = self.window_first != window_before, window_before
                self._start_failed(moved)
            else:
                self._start_failed(self._take_back(committed, window_before))
            raise
        turn = ConversationTurn(
            self,
            committed[-1],
            start.prompt,
            start.generation,
            start.restore,
            started,
            start.window,
            start.messages,
        )
        turn.entered_at = started if entered_at is None else entered_at
        turn.notices.extend(start.window.notices())
        if start.restore.notice:
            turn.notices.append(start.restore.notice)
        return turn

    def commit_reply(self, turn: ConversationTurn) -> Exchange:
        """Commit the reply (the turn calls this when its iteration ends, however it ends)."""
        model_name = self.backend.model_name
        reply = self._store_reply(turn.generation, turn.stats_dict(), model_name)
        self._reply_committed(turn)
        return reply

    # -- what each backend does its own way ----------------------------------------------
    def _start_reply(
        self,
        sampling: Sampling | None,
        max_tokens: int,
        cancel: threading.Event | None,
        fresh: bool,
    ) -> ReplyStart:
        """Fit the window, prepare what the backend needs, and open the reply's stream."""
        raise NotImplementedError

    def _start_failed(self, window_moved: bool) -> None:
        """The reply could not start (the message is already handed back)."""

    def _reply_committed(self, turn: ConversationTurn) -> None:
        """After the reply is stored: where the window starts, for the next open."""
        self._record_window_start()

    @on_compute_thread
    def take_back_last_exchange(self) -> str | None:
        """Step back to before the last question (to answer it again); returns the question.
        The question and its reply stay, as a branch beside the one the next turn writes."""
        questions = [e.record for e in self.exchanges if e.record.role == "user"]
        if not questions:
            return None
        self.branch_before(questions[-1].id)
        return questions[-1].content

    # -- branches ---------------------------------------------------------------------------
    @on_compute_thread
    def branch_before(self, message_id: int) -> None:
        """Put in view the branch up to (not including) a message: the next message sent
        there starts a new branch beside the one that went on from it (an edit of that
        message, or a regenerate); nothing is deleted."""
        index = self.index_of(message_id)
        self._remember_head()
        self.store.set_head(self.record.id, self.exchanges[index].record.parent_id)
        del self.exchanges[index:]
        self.window_first = min(self.window_first, index)
        self._mark_branched()

    def branches_at(self, message_id: int) -> tuple[int, int]:
        """(which, how many): a message's place among the branches that start where it does."""
        record = self.exchanges[self.index_of(message_id)].record
        siblings = [m.id for m in self.store.siblings(record)]
        return siblings.index(record.id) + 1, len(siblings)

    @on_compute_thread
    def switch_branch(self, message_id: int, step: int) -> int | None:
        """Put in view the branch ``step`` places from the one a message is on (its most
        recent continuation); returns the message that starts it there, or None where
        there is no such branch."""
        record = self.exchanges[self.index_of(message_id)].record
        siblings = self.store.siblings(record)
        place = [m.id for m in siblings].index(record.id) + step
        if not 0 <= place < len(siblings):
            return None
        self._show_branch_of(siblings[place].id)
        return siblings[place].id

    def hidden_branches(self) -> bool:
        """Whether the branch in view is empty (a new system prompt, nothing sent under it
        yet) while other branches hold messages."""
        return not self.exchanges and bool(self.store.all_messages(self.record.id))

    @on_compute_thread
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

    @on_compute_thread
    def set_system_prompt(self, text: str | None) -> None:
        """A new system prompt for the branch in view, in place: the next turn reads it all
        again (the cache's head changed). ``branch_system_prompt`` keeps the old one."""
        self.store.set_system_prompt(self.record.id, text or None)
        self.record = self.store.get(self.record.name)
        if self.exchanges:
            self.exchanges[0].record.system_prompt = self.record.system_prompt
        self._mark_branched()

    @on_compute_thread
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
