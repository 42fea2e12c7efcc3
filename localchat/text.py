"""Model output is text: control characters are made visible, never sent to a terminal raw."""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, and C1 controls (ESC and CSI start escapes).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character replaced by its visible ``\\xNN`` form."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
