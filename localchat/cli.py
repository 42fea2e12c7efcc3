"""The ``localchat`` command: the app by default, headless subcommands for everything else.

Every error a user can cause ends as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from localchat import __version__
from localchat.demo import QUANTS, SHAPES, ensure_demo_model, make_demo_model
from localchat.errors import LocalchatError, UsageError
from localchat.paths import app_paths
from localchat.text import printable

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# The model used when none is named and nothing has been downloaded: generated offline.
DEFAULT_DEMO_SHAPE = "small"
DEFAULT_DEMO_QUANT = "Q4_K_M"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line with exit code 2 (no usage dump)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"localchat: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localchat", description="Chat with quantized local LLMs.")
    parser.add_argument("--version", action="version", version=f"localchat {__version__}")
    parser.add_argument("--model-path", type=Path, help="a local GGUF file to chat with")
    parser.add_argument(
        "--demo", action="store_true", help="open the app on the offline demo model"
    )
    parser.add_argument("--ctx", type=_positive_int, default=4096, help="context size in tokens")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    ask = sub.add_parser("ask", help="one headless turn: stream a reply to stdout")
    ask.add_argument("message", help="what to say to the model")
    ask.add_argument("--model-path", type=Path, help="a local GGUF file (default: the demo model)")
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument("--ctx", type=_positive_int, default=4096, help="context size in tokens")
    ask.add_argument("--max-tokens", type=_positive_int, default=256, help="reply length limit")
    ask.add_argument("--temperature", type=_non_negative_float, default=0.7, help="0 is greedy")
    ask.add_argument("--seed", type=int, default=0, help="sampling seed")
    ask.add_argument(
        "--kv-type", default="f16", choices=["f16", "q8_0", "q4_0"], help="KV cache type"
    )
    ask.add_argument("--threads", type=_positive_int, default=None, help="CPU threads")
    ask.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming"
    )

    demo = sub.add_parser("demo-model", help="write a random-weight GGUF for offline use")
    demo.add_argument("out", type=Path, help="where to write the .gguf file")
    demo.add_argument("--shape", default="tiny", choices=list(SHAPES))
    demo.add_argument("--quant", default="Q4_K_M", choices=list(QUANTS))
    demo.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="measure speed and memory (takes minutes)")
    bench.add_argument(
        "--model-path", type=Path, help="benchmark this GGUF instead of a demo model"
    )
    bench.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    bench.add_argument("--quant", default="Q4_K_M", choices=list(QUANTS))
    bench.add_argument("--only", default=None, help="comma-separated parts: engine")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def default_model() -> Path:
    """The offline demo model, generated once into the cache."""
    return ensure_demo_model(app_paths().demo_models_dir, DEFAULT_DEMO_SHAPE, DEFAULT_DEMO_QUANT)


def cmd_ask(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.chat_template import ChatMessage
    from localchat.engine import Engine, LoadOptions, Sampling

    model_path = args.model_path
    if model_path is None:
        model_path = default_model()
        print(
            f"localchat: no --model-path given; using the offline demo model {model_path}",
            file=sys.stderr,
        )
    engine = Engine(
        model_path, LoadOptions(n_ctx=args.ctx, n_threads=args.threads, kv_type=args.kv_type)
    )
    messages = [ChatMessage("system", args.system)] if args.system else []
    messages.append(ChatMessage("user", args.message))
    prompt = engine.prompt_tokens(messages)
    cancel = threading.Event()
    generation = engine.generate(
        prompt, Sampling(temperature=args.temperature, seed=args.seed), args.max_tokens, cancel
    )
    stream = out.isatty()
    interrupted = False
    try:
        for delta in generation:
            if not args.json:
                out.write(printable(delta.text) if stream else delta.text)
                out.flush()
    except KeyboardInterrupt:
        cancel.set()
        interrupted = True
    if args.json:
        stats = generation.stats
        payload = {
            "reply": generation.text,
            "conversation": None,
            "model": model_path.name,
            "stats": {
                "prompt_tokens": stats.prompt_tokens,
                "prompt_tokens_evaluated": stats.prompt_tokens_evaluated,
                "generated_tokens": stats.generated_tokens,
                "ttft_s": round(stats.ttft_s, 6),
                "prompt_tps": round(stats.prompt_tps, 3),
                "gen_tps": round(stats.gen_tps, 3),
                "kv_bytes_used": stats.kv_bytes_used,
                "kv_bytes_allocated": stats.kv_bytes_allocated,
                "restored_from_state": False,
                "window_dropped_messages": 0,
                "stop_reason": stats.stop_reason,
            },
        }
        out.write(json.dumps(payload, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
    engine.close()
    return EXIT_INTERRUPTED if interrupted else 0


def cmd_demo_model(args: argparse.Namespace, out: TextIO) -> int:
    path = make_demo_model(args.out, args.shape, args.quant, args.seed)
    out.write(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.shape}, {args.quant}, seed {args.seed})\n"
    )
    return 0


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.bench import PARTS, format_report, run_bench

    parts = (
        PARTS if args.only is None else tuple(p.strip() for p in args.only.split(",") if p.strip())
    )
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise UsageError(f"unknown bench part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    model_path = args.model_path or ensure_demo_model(
        app_paths().demo_models_dir, args.shape, args.quant
    )
    results = run_bench(model_path, parts, progress=None if args.json else _progress(sys.stderr))
    out.write(json.dumps(results, indent=2) + "\n" if args.json else format_report(results))
    return 0


def cmd_app(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.tui.app import run_app

    model_path = args.model_path
    if model_path is None:
        model_path = default_model()
    return run_app(model_path, n_ctx=args.ctx)


def _progress(stream: TextIO) -> Callable[[str], None]:
    def report(line: str) -> None:
        stream.write(f"bench: {line}\n")
        stream.flush()

    return report


COMMANDS: dict[str | None, Callable[[argparse.Namespace, TextIO], int]] = {
    "ask": cmd_ask,
    "demo-model": cmd_demo_model,
    "bench": cmd_bench,
    None: cmd_app,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, sys.stdout)
    except LocalchatError as exc:
        print(f"localchat: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("localchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
