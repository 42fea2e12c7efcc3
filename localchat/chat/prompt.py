"""A conversation's prompt as token ids: exactly what llama.cpp's own chat path feeds.

The reference is llama.cpp's server: the model's template rendered over the whole
conversation and tokenized in one call (BOS per the vocabulary unless the template writes
it). Tokenizing message by message is not the same: BPE merges across a boundary, and
SentencePiece vocabularies with a space prefix start every separately tokenized piece with
one more space.

What the cache already holds is kept as it was evaluated: a reply's generated ids are not
what re-tokenizing its text gives, and replacing them would miss the cache and change the
continuation. So the prompt is the held tokens up to the point where the bytes they spell
stop agreeing with the whole rendered prompt (at a token boundary of both), then the whole
tokenization from there. Where a template rewrites history (the system prompt moved into
the last user turn, reasoning stripped from earlier replies), the agreement ends there and
the prompt says how many held tokens had to go and in which message.
"""

from __future__ import annotations

import bisect
import codecs
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from localchat.chat.template import ChatMessage, ChatTemplate, TemplateRunaway
from localchat.chat.tools import ToolSpec

Tokenize = Callable[[str], list[int]]
Piece = Callable[[int], bytes]

# A character nobody types, put where the settled text of a message being typed ends: the
# prompt's tokens agree with the probed ones as far as no further typing can change them
# (the template's closing tokens come after it).
_PROBE = "\ue000"
# Tokens before the probe point held back all the same, for tokenizers that merge across it.
SETTLE_MARGIN = 1
# Text with no whitespace for this long (a URL, Chinese or Japanese) is settled but for its
# last few characters.
_LONGEST_WORD = 48
_WORD_TAIL = 16
_LAST_WORD = re.compile(r"\s*\S*\Z")


def settled_chars(text: str) -> int:
    """How much of a message being typed further typing at its end cannot retokenize: all
    but its last word and the whitespace before it (more letters change that word's
    tokens; a space after whitespace joins the next word)."""
    match = _LAST_WORD.search(text)
    cut = match.start() if match else len(text)
    if len(text) - cut > _LONGEST_WORD:
        cut = len(text) - _WORD_TAIL
    return cut


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class BuiltPrompt:
    """The prompt for the next reply and where each message's tokens sit in it."""

    tokens: list[int]
    # (start, end) of each message within ``tokens``, in message order; the first message's
    # span starts at 0 (it carries BOS and whatever the template writes before it).
    spans: list[tuple[int, int]] = field(default_factory=list)
    # Of the held tokens: how many the prompt keeps, and how many of those it still needed
    # had to be re-evaluated instead, and why.
    reused: int = 0
    discarded: int = 0
    discarded_reason: str | None = None

    @property
    def generation_header(self) -> int:
        """Tokens after the last message: the template's cue for the assistant's reply."""
        return len(self.tokens) - (self.spans[-1][1] if self.spans else 0)


class PromptBuilder:
    """Renders messages with a template and tokenizes them as llama.cpp's chat path does."""

    def __init__(
        self,
        template: ChatTemplate,
        tokenize: Tokenize,
        bos: list[int],
        piece: Piece,
        now: datetime | None = None,
        tools: list[ToolSpec] | None = None,
    ) -> None:
        self.template = template
        self.tools = tools  # rendered at the prompt's head: another set re-reads the history
        self.tokenize = tokenize
        self.bos = bos
        self.piece = piece
        self.now = now
        self._pieces: dict[int, bytes] = {}
        self._preamble_tokens: list[int] | None = None
        # The last build's messages, whole prompt and per-prefix agreements (see _message_ends).
        self._last_ends: tuple[tuple[ChatMessage, ...], list[int], list[int | None]] = (
            (),
            [],
            [],
        )

    def tokens_of(self, text: str) -> list[int]:
        """``text`` tokenized in one call, with BOS unless the text starts with it."""
        bos_text = self.template.bos_token
        bos = [] if bos_text and text.startswith(bos_text) else self.bos
        return list(bos) + self.tokenize(text)

    def render(self, messages: Sequence[ChatMessage], generation_prompt: bool = True) -> str:
        return self.template.render(list(messages), generation_prompt, self.now, self.tools)

    def build(self, messages: Sequence[ChatMessage], held: Sequence[int] = ()) -> BuiltPrompt:
        """The token ids that ask the model for the next assistant reply.

        ``held`` is what the cache (warm, saved or replayable) holds for this conversation.
        """
        whole = self.tokens_of(self.render(messages, True))
        bounds = self._message_ends(messages, whole)
        kept, at, to_prompt = self._agreement(held, whole)
        tokens = list(held[:kept]) + whole[at:]
        start = 0
        if messages and messages[0].role == "user":
            preamble = self._preamble()
            if whole[: len(preamble)] == preamble:
                start = to_prompt(len(preamble))
        ends = [to_prompt(b) for b in bounds]
        spans = list(itertools.pairwise([start, *ends]))
        # Held tokens past the prompt's end (a regenerated reply, a shorter window) are not
        # history the prompt needs; only those it had to replace count as discarded.
        # (Never below 0: held ids may spell the prompt's text in more tokens than it has.)
        discarded = max(0, min(len(held), len(whole)) - kept)
        prompt = BuiltPrompt(tokens, spans, kept, discarded)
        if prompt.discarded:
            # An end that falls exactly where the agreement stops is where that message began
            # to read differently (its end was found by the same comparison).
            index = bisect.bisect_left(ends, kept)
            where = (
                f"message {index + 1} ({messages[index].role})"
                if index < len(messages)
                else "the reply's cue"
            )
            prompt.discarded_reason = f"the chat template renders {where} differently now"
        return prompt

    def build_draft(
        self, messages: Sequence[ChatMessage], held: Sequence[int] = (), cut: int | None = None
    ) -> tuple[BuiltPrompt, int]:
        """The prompt for ``messages`` whose last one is still being typed, and how many of
        its leading tokens no further typing at that message's end can change: the
        template's header for it and its text but the last word (``settled_chars``), or its
        first ``cut`` characters whatever follows them."""
        prompt = self.build(messages, held)
        *before, draft = messages
        end = settled_chars(draft.content) if cut is None else cut
        probe = replace(draft, content=draft.content[:end] + _PROBE)  # its images kept
        probed = self.build([*before, probe], held)
        return prompt, max(0, common_prefix(prompt.tokens, probed.tokens) - SETTLE_MARGIN)

    def _preamble(self) -> list[int]:
        """What the template writes before a first user message (BOS, a default system
        prompt, a date header): it stays at the head of the window like a system prompt.

        Found with probes: two conversations that differ only in the first user message's
        text agree up to that text; the user header's own length is measured where a user
        message follows a reply."""
        if self._preamble_tokens is None:
            self._preamble_tokens = []

            def probe(*texts: str) -> list[int]:
                roles = ("user", "assistant")
                chat = [ChatMessage(roles[i % 2], t) for i, t in enumerate(texts)]
                return self.tokens_of(self.render(chat, False))

            try:
                one, other = probe("\x01 a"), probe("\x02 b")
                replied = probe("\x01 a", "ok", "\x01 a")
                reply_end = common_prefix(probe("\x01 a", "ok"), replied)
                header = common_prefix(replied, probe("\x01 a", "ok", "\x02 b")) - reply_end
                self._preamble_tokens = one[: max(0, common_prefix(one, other) - header)]
            except TemplateRunaway:  # hostile or broken: never taken for "not supported"
                raise
            except Exception:  # a template that rejects the probes: no preamble is known
                pass
        return self._preamble_tokens

    def _message_ends(self, messages: Sequence[ChatMessage], whole: list[int]) -> list[int]:
        """Where each message ends in ``whole``: how far the tokens of the conversation up to
        and including it agree with the whole prompt (never before the previous end).

        Tokenizing every prefix costs O(n²) in the conversation's length, so the last build's
        agreements are kept: a prefix of unchanged messages whose agreement ended before the
        point where this whole prompt first differs from the last one agrees just as far."""
        last_messages, last_whole, last_raw = self._last_ends
        unchanged = common_prefix(last_messages, messages)
        same_until = common_prefix(last_whole, whole)
        raw: list[int | None] = []
        ends: list[int] = []
        previous = 0
        for k in range(1, len(messages) + 1):
            agreed: int | None = None
            known = last_raw[k - 1] if k <= unchanged else None
            if known is not None and known < same_until:
                agreed = known
            else:
                try:
                    upto = self.tokens_of(self.render(messages[:k], False))
                    agreed = common_prefix(upto, whole)
                except TemplateRunaway:
                    raise
                except Exception:  # a template that rejects this prefix: the end is unknown
                    agreed = None
            raw.append(agreed)
            previous = max(previous, agreed or 0)
            ends.append(previous)
        self._last_ends = (tuple(messages), whole, raw)
        return ends

    def _bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.piece(token)
        return piece

    def _spelled(self, tokens: Sequence[int]) -> tuple[str, list[int]]:
        """The text ``tokens`` spell (as a reply's text is decoded: invalid UTF-8 becomes
        U+FFFD) and the character offset of each token boundary; -1 where a boundary falls
        inside a character."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts: list[str] = []
        offsets = [0]
        length = 0
        for token in tokens:
            text = decoder.decode(self._bytes(token))
            parts.append(text)
            length += len(text)
            offsets.append(-1 if decoder.getstate()[0] else length)
        return "".join(parts), offsets

    def _agreement(
        self, held: Sequence[int], whole: list[int]
    ) -> tuple[int, int, Callable[[int], int]]:
        """(k, j, to_prompt): ``held[:k]`` spells the same text as ``whole[:j]``, both at
        token boundaries, with k as large as possible; ``to_prompt`` maps a token boundary of
        ``whole`` to its position in ``held[:k] + whole[j:]``.

        Text, not bytes: a reply whose generated bytes were not valid UTF-8 is stored (and
        re-rendered) with U+FFFD, and its ids as generated still stand for it."""
        same = common_prefix(held, whole)
        if same == len(held) or same == len(whole):
            return same, same, lambda boundary: boundary
        held_text, held_at = self._spelled(held)
        whole_text, whole_at = self._spelled(whole)
        agree = common_prefix(held_text, whole_text)
        whole_index = {offset: j for j, offset in enumerate(whole_at) if offset >= 0}
        kept = at = same
        for k in range(len(held), same, -1):
            if 0 <= held_at[k] <= agree and held_at[k] in whole_index:
                kept, at = k, whole_index[held_at[k]]
                break
        # Boundaries inside a character count as the last whole character before them.
        whole_chars = list(itertools.accumulate(whole_at, max))
        held_points = [(o, k) for k, o in enumerate(held_at[: kept + 1]) if o >= 0]
        held_offsets = [o for o, _ in held_points]

        def to_prompt(boundary: int) -> int:
            if boundary >= at:
                return boundary - at + kept
            offset = whole_chars[boundary]
            return held_points[bisect.bisect_right(held_offsets, offset) - 1][1]

        return kept, at, to_prompt
