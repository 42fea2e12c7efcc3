"""The ``localchat`` command: the app by default, headless subcommands for everything else.

Every error ends as one line on stderr, never a traceback: exit code 2 for the user's
mistakes, 1 when the network, a server or the disk failed. Each command area has its own
module (``ask``, ``conversations``, ``models``); this one dispatches, and runs the app and
the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from localchat.cli.ask import cmd_ask
from localchat.cli.conversations import (
    cmd_branch,
    cmd_conversations,
    cmd_export,
    cmd_rm_conversation,
)
from localchat.cli.interrupt import EXIT_INTERRUPTED
from localchat.cli.models import (
    cmd_add,
    cmd_demo_model,
    cmd_hw,
    cmd_models,
    cmd_pull,
    cmd_rm,
)
from localchat.cli.parser import EXIT_USAGE, EXIT_WORLD, build_parser, launch_flags
from localchat.cli.progress import line_progress
from localchat.cli.serve import cmd_serve
from localchat.cli.tools import cmd_tools
from localchat.errors import LocalchatError, UsageError, WorldError, one_line
from localchat.paths import app_paths


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.bench.run import PARTS, format_report, run_bench
    from localchat.models.demo import ensure_demo_model

    parts = (
        PARTS if args.only is None else tuple(p.strip() for p in args.only.split(",") if p.strip())
    )
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise UsageError(f"unknown bench part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    model_path = args.model_path or ensure_demo_model(
        app_paths().demo_models_dir, args.shape, args.quant
    )
    progress = None if args.json else line_progress(sys.stderr)
    results = run_bench(model_path, parts, progress=progress)
    out.write(json.dumps(results, indent=2) + "\n" if args.json else format_report(results))
    return 0


def cmd_app(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.cli import interrupt
    from localchat.tui.app import run_app

    interrupt.uninstall()  # the app handles Ctrl+C as a key, and its loop the signal
    return run_app(
        args.model_path,
        launch_flags(args),
        model_name=args.model,
        demo=args.demo,
        server=args.server,
    )


COMMANDS: dict[str | None, Callable[[argparse.Namespace, TextIO], int]] = {
    "ask": cmd_ask,
    "serve": cmd_serve,
    "demo-model": cmd_demo_model,
    "bench": cmd_bench,
    "hw": cmd_hw,
    "tools": cmd_tools,
    "pull": cmd_pull,
    "models": cmd_models,
    "rm": cmd_rm,
    "add": cmd_add,
    "conversations": cmd_conversations,
    "export": cmd_export,
    "branch": cmd_branch,
    "rm-conversation": cmd_rm_conversation,
    None: cmd_app,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, sys.stdout)
    except WorldError as exc:
        print(f"localchat: error: {exc}", file=sys.stderr)
        return EXIT_WORLD
    except LocalchatError as exc:
        print(f"localchat: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("localchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except OSError as exc:  # the disk or the system failed: one line, never a traceback
        print(f"localchat: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_WORLD


if __name__ == "__main__":
    from localchat.cli import interrupt

    sys.exit(interrupt.run(main))
