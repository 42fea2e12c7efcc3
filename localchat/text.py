"""Model output is text: control characters are made visible, never sent to a terminal raw."""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, and C1 controls (ESC and CSI start escapes).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character replaced by its visible ``\\xNN`` form."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def shown(name: str, limit: int = 60) -> str:
    """Outside text (a file's header, a server's answer) as an error may show it: one short
    line, control characters spelled out (it can hold any bytes and be of any length)."""
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in name[: limit + 1])
    return text if len(name) <= limit else text[:limit] + "…"
