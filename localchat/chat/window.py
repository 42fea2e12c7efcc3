"""Which messages are in the context window, and how the cache follows when it moves.

The transcript keeps everything; the window is the system prompt (always, like llama.cpp's
n_keep) and the pinned messages, plus the newest messages that fit with room for the reply.
When the next turn would not fit, the oldest whole exchanges (a user message and its reply
leave together) drop out — pinned ones stay — and enough at once (a share of the context)
that it does not happen again next turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localchat.errors import UsageError

WINDOW_MODES = ("auto", "shift", "exact")

# Families where shifting the KV cache in place is known to corrupt output: sliding-window
# attention (Gemma 2/3, Cohere 2), MLA (DeepSeek 2/3, Kimi), M-RoPE multimodal (Qwen2-VL…).
UNSAFE_SHIFT_ARCHITECTURES = frozenset(
    {
        "gemma2",
        "gemma3",
        "gemma3n",
        "cohere2",
        "deepseek2",
        "deepseek3",
        "minicpm3",
        "qwen2vl",
        "qwen25vl",
        "qwen3vl",
        "qwen3vlmoe",
    }
)


@dataclass(frozen=True)
class WindowPolicy:
    """How much room the reply gets, and how much leaves the window when it moves."""

    reply_reserve_share: float = 0.25
    """The reply's room is --max-tokens, capped at this share of the context."""

    drop_share: float = 0.25
    """When the window moves, at least this share of the context leaves at once."""

    def reserve(self, n_ctx: int, max_tokens: int) -> int:
        return max(1, min(max_tokens, int(n_ctx * self.reply_reserve_share)))


@dataclass(frozen=True)
class WindowPlan:
    """The window for the next turn: the first message that stays, what left, what was cut."""

    first: int
    dropped_messages: int
    dropped_tokens: int
    cut_tokens: int = 0  # tokens cut from the start of the newest message (it alone is too long)

    @property
    def moved(self) -> bool:
        return self.dropped_messages > 0


def plan_window(
    head_tokens: int,
    messages: Sequence[tuple[str, int]],
    first: int,
    n_ctx: int,
    reserve: int,
    policy: WindowPolicy,
    header_tokens: int = 0,
    pinned: Sequence[bool] = (),
) -> WindowPlan:
    """Choose the window for a prompt of ``head_tokens`` + messages[first:] + the header.

    ``messages`` are every message's (role, token count), the user's new message last;
    messages before ``first`` already left the window. The window always starts at a user
    message, so a reply never stays without the question it answers. ``pinned`` messages
    never leave: the window's start passes them by (they join the head).
    """
    budget = n_ctx - reserve - header_tokens
    if head_tokens + 1 > budget:
        minimum = head_tokens + reserve + header_tokens + 16
        raise UsageError(
            f"the context ({n_ctx} tokens) cannot hold the system prompt ({head_tokens} tokens)"
            f" plus room for the reply ({reserve}); use --ctx {minimum} or more"
        )
    newest = len(messages) - 1
    total = head_tokens + sum(count for _, count in messages[first:])
    if total <= budget:
        return WindowPlan(first, 0, 0)
    must_drop = max(total - budget, int(n_ctx * policy.drop_share))
    # Never past the last user message: a turn that reads tool results keeps the question,
    # the calls and their results together (what is still too long is cut, as it says).
    users = [i for i in range(first, newest + 1) if messages[i][0] == "user"]
    last = users[-1] if users else newest
    start, dropped, left = first, 0, 0
    while start < last and (dropped < must_drop or messages[start][0] != "user"):
        if not (start < len(pinned) and pinned[start]):
            dropped += messages[start][1]
            left += 1
        start += 1
    remaining = total - dropped
    return WindowPlan(start, left, dropped, max(0, remaining - budget))


def shift_is_safe(architecture: str, sliding_window: int, can_shift: bool) -> bool:
    """Whether shifting the cache in place keeps this model's output sound."""
    return can_shift and sliding_window == 0 and architecture not in UNSAFE_SHIFT_ARCHITECTURES


def resolve_mode(mode: str, safe: bool) -> str:
    """The mode a turn uses: ``shift`` or ``exact`` (``auto`` shifts only where safe)."""
    if mode not in WINDOW_MODES:
        raise UsageError(f"unknown window mode {mode!r}; choose one of {', '.join(WINDOW_MODES)}")
    if mode == "exact" or not safe:
        return "exact"
    return "shift"
