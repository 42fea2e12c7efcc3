"""The ``localchat`` command's entry point: Ctrl+C handled from the first moment, so the
command's imports (most of a second on a busy machine) stop as cleanly as the command."""

from __future__ import annotations

from localchat.cli import interrupt

# At import, not in ``main``: the console script imports this module first thing, and a
# Ctrl+C between that import and the call would still be Python's traceback.
interrupt.install()


def main() -> int:
    """Run the CLI under the Ctrl+C policy (``cli/interrupt.py``)."""
    return interrupt.run(_command)


def _command() -> int:
    from localchat.cli.main import main as cli_main

    return cli_main()
