"""A small model of the same family loaded beside the big one, drafting the tokens it
would write next for the big one to verify (``--draft-model``).

Drafting costs a few small-model steps per big-model step, so it pays where the big model's
step is slow and its tokens are often the small one's (Qwen2.5-0.5B for Qwen2.5-7B). The
draft's cache follows the conversation by its tokens: each call evaluates only what the
context gained since the last (the drafts the big model kept are already there). Where it
fell far behind (a conversation opened from its saved state, another branch, a full draft
context) it is rebuilt from the context's last ``REBUILD_TOKENS`` only: drafting needs the
recent text, and a rebuild stays a fraction of a second on a laptop.
"""

from __future__ import annotations

import time
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from localchat.backends.llama.draft_policy import DRAFT_CTX
from localchat.backends.llama.internals import last_logits
from localchat.backends.llama.runtime import last_error_line
from localchat.chat.prompt import common_prefix
from localchat.errors import ModelLoadError, UsageError

REBUILD_TOKENS = 256  # what a rebuilt cache holds: the context's last tokens
# A draft stops before a token the small model gives less than this chance (llama.cpp's
# ``--draft-p-min``): unsure tokens are mostly rejected, and each costs a small step.
MIN_CONFIDENCE = 0.75
# llama.cpp's rule for "the same vocabulary": sizes within 128 (padding) and the same text
# for every token past the first few (control tokens may be named differently).
VOCAB_SIZE_SLACK = 128
FIRST_COMPARED_TOKEN = 5
STEP_WEIGHT = 0.3  # of the newest timing in the running cost of one draft step


def vocabulary_mismatch(
    target: llama_cpp.llama_model_p, draft: llama_cpp.llama_model_p
) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (their token ids mean different things), or
    None where it can."""
    ours = llama_cpp.llama_model_get_vocab(target)
    theirs = llama_cpp.llama_model_get_vocab(draft)
    if llama_cpp.llama_vocab_type(ours) != llama_cpp.llama_vocab_type(theirs):
        return "their tokenizers are of different kinds"
    if llama_cpp.llama_vocab_bos(ours) != llama_cpp.llama_vocab_bos(theirs) or (
        llama_cpp.llama_vocab_eos(ours) != llama_cpp.llama_vocab_eos(theirs)
    ):
        return "their start and end tokens differ"
    n_ours, n_theirs = llama_cpp.llama_vocab_n_tokens(ours), llama_cpp.llama_vocab_n_tokens(theirs)
    if abs(n_ours - n_theirs) > VOCAB_SIZE_SLACK:
        return f"their vocabularies have {n_ours} and {n_theirs} tokens"
    text = llama_cpp.llama_vocab_get_text
    for token in range(FIRST_COMPARED_TOKEN, min(n_ours, n_theirs)):
        if text(ours, token) != text(theirs, token):
            return f"token {token} is {text(ours, token)!r} in one and {text(theirs, token)!r} in the other"
    return None


class DraftModel:
    """The small model and its cache; ``draft`` returns its greedy continuation of a
    context. Runs on the compute thread, like the model it drafts for."""

    def __init__(self, path: Path, target: llama_cpp.Llama, n_ctx: int, threads: int) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise UsageError(f"{self.path}: no such draft model file; give a .gguf or a model name")
        n_ctx = min(n_ctx, DRAFT_CTX)
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(self.path),
                n_ctx=n_ctx,
                n_batch=min(512, n_ctx),
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{self.path}: llama.cpp could not load the draft model: {last_error_line()}"
            ) from exc
        why = vocabulary_mismatch(target.model, self.llm.model)
        if why is not None:
            self.close()
            raise UsageError(
                f"{self.path.name} cannot draft for {Path(target.model_path).name}: {why};"
                " choose a smaller model of the same family"
            )
        self.n_vocab = int(self.llm.n_vocab())
        # Ids the big model has: a vocabulary may be padded by up to VOCAB_SIZE_SLACK.
        self.usable_vocab = min(self.n_vocab, int(target.n_vocab()))
        # A rebuilt cache holds the context's last tokens, and room to draft after them.
        self.rebuild_tokens = min(REBUILD_TOKENS, n_ctx // 2)
        self.offset = 0  # the context position of the draft cache's first token
        self.step_s: float | None = None  # a drafted token's cost, measured as it goes
        self.calls = 0  # drafts asked for
        self.rebuilds = 0  # times the cache was rebuilt from the context's last tokens
        self.evaluated = 0  # tokens the draft model evaluated, drafts included

    @property
    def name(self) -> str:
        return self.path.name

    def draft(self, context: npt.NDArray[np.intc], limit: int) -> list[int]:
        """Up to ``limit`` tokens the small model would write after ``context``, greedily,
        stopping before one it is unsure of. What it cost (catching up with the context
        included) is counted per drafted token in ``step_s``."""
        started = time.perf_counter()
        self.calls += 1
        self._follow(context)
        tokens: list[int] = []
        while len(tokens) < limit:
            logits = last_logits(self.llm, self.n_vocab)[: self.usable_vocab]
            best = int(np.argmax(logits))
            if 1.0 / float(np.exp(logits - logits[best]).sum()) < MIN_CONFIDENCE:
                break
            tokens.append(best)
            if len(tokens) < limit:
                self.llm.eval([best])
                self.evaluated += 1
        self._record_step((time.perf_counter() - started) / max(1, len(tokens)))
        return tokens

    def _follow(self, context: npt.NDArray[np.intc]) -> None:
        """Bring the cache to ``context``: keep what it shares, evaluate the rest; rebuild
        from the last tokens where that would read more than a rebuild."""
        llm = self.llm
        seen = context[self.offset :] if self.offset < len(context) else context[:0]
        shared = common_prefix(llm.input_ids[: llm.n_tokens].tolist(), seen.tolist())
        if self.offset and not shared:  # its window's start is not this context's
            seen = context[:0]
        behind = len(seen) - shared
        if len(seen) == 0 or behind > self.rebuild_tokens or len(seen) >= llm.n_ctx() - 16:
            self.offset = max(0, len(context) - self.rebuild_tokens)
            seen, shared = context[self.offset :], 0
            self.rebuilds += 1
        shared = min(shared, len(seen) - 1)  # the last token again: its logits
        llm.n_tokens = shared
        llm.eval(seen[shared:].tolist())
        self.evaluated += len(seen) - shared

    def _record_step(self, seconds: float) -> None:
        before = self.step_s
        self.step_s = seconds if before is None else before + STEP_WEIGHT * (seconds - before)

    def close(self) -> None:
        self.llm.close()
