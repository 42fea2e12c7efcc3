"""No tool runs without the user saying so: which tools the user allowed, and for how long."""

from __future__ import annotations

from dataclasses import dataclass, field

from localchat.chat.tools import ToolCall

# What the user may answer when a call waits for consent.
RUN_ONCE, ALWAYS, DENY = "once", "always", "deny"
DENIED_RESULT = "error: the user did not allow this call"
# Rounds of calls one message leads to at most: a model that keeps calling stops there
# (``STOPPED`` said to the user, ``STOPPED_RESULT`` what the calls left get).
MAX_ROUNDS = 8
STOPPED = f"localchat stops after {MAX_ROUNDS} rounds of tool calls"
STOPPED_RESULT = f"error: {STOPPED}"


@dataclass
class Consent:
    """Tools allowed without asking: named ones (``ask --allow-tool``, "always for this tool"
    in a conversation), or all of them (``ask --yes``)."""

    allowed: set[str] = field(default_factory=set)
    everything: bool = False

    def allows(self, call: ToolCall) -> bool:
        return self.everything or call.name in self.allowed

    def answer(self, call: ToolCall, choice: str) -> bool:
        """Record the user's ``choice`` for ``call``; whether it runs."""
        if choice == ALWAYS:
            self.allowed.add(call.name)
        return choice in (RUN_ONCE, ALWAYS)
