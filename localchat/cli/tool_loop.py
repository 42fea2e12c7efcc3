"""``ask`` with tools: the calls a reply makes run only where the user allowed them
(``--allow-tool NAME``, ``--yes``); their results go back to the model, whose next reply
reads only them (the cache holds the rest), until a reply calls nothing."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from localchat.chat.template import ChatMessage
from localchat.chat.tools import ToolCall
from localchat.text import shown
from localchat.tools.consent import Consent
from localchat.tools.results import ToolResult

if TYPE_CHECKING:
    from localchat.session import Session


@dataclass
class CallRecord:
    """A call and what became of it (``result`` None: the user did not allow it)."""

    call: ToolCall
    result: ToolResult | None

    def as_json(self) -> dict[str, Any]:
        result = self.result
        return {
            "id": self.call.id,
            "name": self.call.name,
            "arguments": self.call.arguments,
            "allowed": result is not None,
            "result": None if result is None else result.text,
            "is_error": None if result is None else result.is_error,
        }


class AskTools:
    """Runs a reply's calls as the user allowed, saying on stderr what runs and what came
    back (one line each: a result is text, cut and with control characters shown)."""

    def __init__(self, session: Session, consent: Consent, err: TextIO | None = None) -> None:
        self.session = session
        self.consent = consent
        self.err = err
        self.records: list[CallRecord] = []

    @property
    def refused(self) -> list[ToolCall]:
        return [r.call for r in self.records if r.result is None]

    def run(self, calls: list[ToolCall]) -> list[ChatMessage] | None:
        """The results of ``calls`` as ``tool`` messages; None if any was not allowed (none
        of them run then: the ask stops, saying how to allow them)."""
        if not all(self.consent.allows(call) for call in calls):
            for call in calls:
                self.records.append(CallRecord(call, None))
                if not self.consent.allows(call):
                    self._say(
                        f"the model called {_spelled(call)}; not run: allow it with"
                        f" --allow-tool {shown(call.name)} (or --yes)"
                    )
            return None
        results = []
        for call in calls:
            self._say(f"running {_spelled(call)}")
            result = self.session.run_tool(call)
            self.records.append(CallRecord(call, result))
            outcome = "failed" if result.is_error else "returned"
            self._say(f"{shown(call.name)} {outcome}: {shown(result.text, 200)}")
            results.append(ChatMessage("tool", result.text, tool_call_id=call.id))
        return results

    def _say(self, line: str) -> None:
        print(f"localchat: tool: {line}", file=self.err or sys.stderr)


def _spelled(call: ToolCall) -> str:
    """``name({"arg": …})`` on one line, shortened."""
    return shown(f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})", 200)
