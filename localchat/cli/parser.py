"""The command line's grammar: argument types, the flags of each subcommand, exit codes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from localchat import __version__
from localchat.backends.base import SPECULATIVE_MODES
from localchat.errors import UsageError
from localchat.models.demo_shapes import QUANTS, SHAPES, TOKENIZERS
from localchat.models.launch import LaunchOptions

EXIT_USAGE = 2  # the user's mistake: a bad flag, an unknown name, an unusable file
EXIT_WORLD = 1  # the world failed: network, server, disk

DEFAULT_WAIT_S = 5.0  # ask --wait: a busy conversation is usually free within seconds


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


def _size(text: str) -> int:
    from localchat.units import parse_size

    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line with exit code 2 (no usage dump)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"localchat: error: {message} (see `{self.prog} --help`)\n")


def _model_flags(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """The flags that choose and load a model, defined once for the app and for ``ask``."""
    parser.add_argument(
        "--model-path", type=Path, default=default, help="a local GGUF file to chat with"
    )
    parser.add_argument(
        "--model",
        metavar="NAME[:QUANT]",
        default=default,
        help="a catalog or hub model (downloaded if needed); with --server, one of its models",
    )
    parser.add_argument(
        "--server",
        metavar="URL|NAME",
        default=default,
        help="chat through an OpenAI-compatible server (its API base, e.g."
        " http://gpu-box:8000/v1, or a [[servers]] name from settings.toml); the key comes"
        " from LOCALCHAT_API_KEY or OPENAI_API_KEY",
    )
    _load_flags(parser, default)


def _load_flags(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """The flags that say how a model runs (``launch_flags`` gathers them)."""
    parser.add_argument(
        "--ctx",
        type=_positive_int,
        default=default,
        help="context size in tokens (default: 4096, or the model's trained context if smaller)",
    )
    parser.add_argument(
        "--template",
        metavar="NAME|FILE",
        default=default,
        help="chat template: chatml, llama3, gemma, mistral, phi3, plain, or a .jinja file",
    )
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default=default,
        help="speculative decoding: ngram (prompt lookup), draft (the draft model), off, or"
        " auto: both where replies stay exactly the same (default: the speculative setting)",
    )
    parser.add_argument(
        "--draft-model",
        metavar="NAME|FILE",
        default=default,
        help="a smaller model of the same family that drafts tokens for the big one to verify"
        " (default: the draft_model setting, else the one the catalog names where it pays)",
    )
    parser.add_argument(
        "--mmproj",
        metavar="FILE|none",
        default=default,
        help="the vision projector that lets the model read images (default: the mmproj-*.gguf"
        " beside the model that fits it; none: no images)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localchat", description="Chat with quantized local LLMs.")
    parser.add_argument("--version", action="version", version=f"localchat {__version__}")
    parser.add_argument(
        "--demo", action="store_true", help="open the app on the offline demo model"
    )
    _model_flags(parser)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _ask_flags(sub.add_parser("ask", help="one headless turn: stream a reply to stdout"))
    _conversation_commands(sub)
    _model_commands(sub)
    _serve_flags(sub.add_parser("serve", help="serve the model over an OpenAI-compatible API"))

    bench = sub.add_parser("bench", help="measure speed and memory (takes minutes)")
    bench.add_argument(
        "--model-path", type=Path, help="benchmark this GGUF instead of a demo model"
    )
    bench.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    bench.add_argument("--quant", default="Q4_K_M", choices=list(QUANTS))
    bench.add_argument(
        "--only",
        default=None,
        help="comma-separated parts (default: all): engine, resume, window, estimate, ui,"
        " calibrate, plan, memory, remote, zerowait, branch, spec, serve, clients, embed, router,"
        " vision",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: use 1 to 65535")
    return value


def _serve_flags(serve: argparse.ArgumentParser) -> None:
    _serve_model_flags(serve)
    _serve_listen_flags(serve)


def _serve_model_flags(serve: argparse.ArgumentParser) -> None:
    """Which models ``serve`` serves, how many stay loaded, and how they run."""
    serve.add_argument(
        "--model-path", type=Path, action="append", default=[],
        help="a local GGUF file to serve (repeatable)",
    )  # fmt: skip
    serve.add_argument(
        "--model", metavar="NAME[:QUANT]", action="append", default=[],
        help="a catalog or hub model to serve (repeatable; the first is loaded at start and"
        " answers requests that name none); none given: every model `localchat models`"
        " lists, each loaded when a request asks for it",
    )  # fmt: skip
    serve.add_argument("--server", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _load_flags(serve, default=argparse.SUPPRESS)
    serve.add_argument(
        "--max-models", type=_positive_int, default=None,
        help="models loaded at once (default: [serve] max_models, else what memory allows);"
        " the least recently used idle one is unloaded first, its states saved",
    )  # fmt: skip
    serve.add_argument(
        "--keep-alive", metavar="DURATION", default=None,
        help="how long a model loaded on demand stays loaded once idle: 10m, 1h, 0 (unload"
        " after each reply), -1 (until room is needed); default: [serve] keep_alive, 30m",
    )  # fmt: skip


def _serve_listen_flags(serve: argparse.ArgumentParser) -> None:
    """Where ``serve`` listens, whom it answers, what it logs, and its sequences."""
    serve.add_argument(
        "--host", default=None, help="address to bind (default: [serve] host, else loopback)"
    )
    serve.add_argument("--port", type=_port, default=None, help="port (default: 8080)")
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="text: a live status line on a terminal, a line per request elsewhere; json: a"
        " JSON object per request (services)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="clients must send it as a Bearer token (default: LOCALCHAT_API_KEY; needed to"
        " bind other than loopback)",
    )
    serve.add_argument(
        "--no-auth",
        action="store_true",
        help="serve other machines without an API key (anyone who can reach the port can use it)",
    )
    serve.add_argument(
        "--kv-type",
        default=None,
        choices=["f16", "q8_0", "q4_0"],
        help="KV cache type (default: the kv_type setting); q8_0 halves memory and saved states",
    )
    serve.add_argument("--threads", type=_positive_int, default=None, help="CPU threads")
    serve.add_argument(
        "--parallel",
        type=_positive_int,
        default=None,
        help="requests answered side by side, each with its own --ctx (default: [serve]"
        " parallel, else what memory allows, at most 4)",
    )
    serve.add_argument(
        "--alias",
        metavar="NAME",
        action="append",
        default=[],
        help="another name the model is listed under (repeatable); a name not listed is"
        " answered by the model too",
    )
    _embedding_flag(serve)
    serve.add_argument(
        "--cors-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="let pages from ORIGIN (e.g. http://localhost:3000) call the API from a browser"
        " (repeatable; off by default)",
    )


def _embedding_flag(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--embedding-model",
        metavar="PATH_OR_NAME",
        default=None,
        help="also serve embeddings (/v1/embeddings, /api/embed) with this GGUF or catalog"
        " model, e.g. nomic-embed-text-v1.5 (the chat model itself answers too, mean-pooled)",
    )


def _ask_flags(ask: argparse.ArgumentParser) -> None:
    """``ask``'s flags, grouped by what they set (in the order ``--help`` lists them)."""
    _ask_message_flags(ask)
    _ask_sampling_flags(ask)
    _ask_runtime_flags(ask)
    ask.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming"
    )
    _ask_conversation_flags(ask)
    _ask_tool_flags(ask)
    ask.add_argument(
        "--window",
        choices=["auto", "shift", "exact"],
        default=None,
        help="when old messages leave the context: shift the cache in place (auto: where safe)"
        " or re-evaluate the window exactly (default: the window_mode setting)",
    )


def _ask_message_flags(ask: argparse.ArgumentParser) -> None:
    """What is said, to which model: the message, the model flags, the system prompt, files."""
    ask.add_argument(
        "message", nargs="?", help="what to say to the model (- or nothing: read it from stdin)"
    )
    # The same flags as before the subcommand: given on either side, they count.
    _model_flags(ask, default=argparse.SUPPRESS)
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument(
        "--attach",
        metavar="FILE",
        type=Path,
        action="append",
        default=[],
        help="put a file into the message: a text file (code, Markdown, logs) under its name,"
        " an image (PNG, JPEG, GIF, BMP, WebP) for a vision model to read; repeatable",
    )
    ask.add_argument(
        "--image",
        metavar="FILE",
        type=Path,
        action="append",
        default=[],
        help="show the model an image (PNG, JPEG, GIF, BMP, WebP); repeatable",
    )


def _ask_sampling_flags(ask: argparse.ArgumentParser) -> None:
    """How the reply is drawn: its length limit, temperature and seed."""
    ask.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help="reply length limit (setting max_tokens)",
    )
    ask.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=None,
        help="0 is greedy (setting temperature)",
    )
    ask.add_argument("--seed", type=int, default=0, help="sampling seed")


def _ask_runtime_flags(ask: argparse.ArgumentParser) -> None:
    """How a local model runs: its KV cache type and threads."""
    ask.add_argument(
        "--kv-type",
        default=None,
        choices=["f16", "q8_0", "q4_0"],
        help="KV cache type (default: the kv_type setting); q8_0 halves memory and state files",
    )
    ask.add_argument("--threads", type=_positive_int, default=None, help="CPU threads")


def _ask_conversation_flags(ask: argparse.ArgumentParser) -> None:
    """Which saved conversation the turn continues, and how its saved state is used."""
    ask.add_argument(
        "--conversation", metavar="NAME", help="continue (or start) this saved conversation"
    )
    ask.add_argument("--fresh", action="store_true", help="ignore the saved KV cache; re-evaluate")
    ask.add_argument(
        "--wait",
        metavar="SECONDS",
        type=_non_negative_float,
        default=DEFAULT_WAIT_S,
        help=f"wait this long for a conversation another process is answering (default {DEFAULT_WAIT_S:g})",
    )


def _ask_tool_flags(ask: argparse.ArgumentParser) -> None:
    """Which MCP tools the model may run without asking, and whether it must call one."""
    ask.add_argument(
        "--allow-tool",
        metavar="NAME",
        action="append",
        default=[],
        help="let the model run this MCP tool without asking; repeatable",
    )
    ask.add_argument(
        "--yes", action="store_true", help="let the model run every MCP tool without asking"
    )
    ask.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|none|required|NAME",
        help="auto: the model decides; none: no tools; required: it must call one; NAME: it"
        " must call that one (default auto)",
    )


def _conversation_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    conversations = sub.add_parser("conversations", help="list saved conversations")
    conversations.add_argument("--json", action="store_true", help="print JSON")
    export = sub.add_parser("export", help="print a conversation as Markdown or JSON")
    export.add_argument("name")
    export.add_argument("--format", choices=["md", "json"], default="md")
    export.add_argument(
        "--reasoning", action="store_true", help="include a reasoning model's thinking"
    )
    branch = sub.add_parser(
        "branch", help="fork a conversation at a message into a new one (from its saved cache)"
    )
    branch.add_argument("name")
    branch.add_argument(
        "--at", type=int, required=True, help="keep its first N messages (questions and replies)"
    )
    branch.add_argument("--as", dest="new_name", help="the new conversation's name")
    rm_conv = sub.add_parser(
        "rm-conversation", help="delete a conversation and its saved KV states"
    )
    rm_conv.add_argument("name")


def _model_commands(sub: argparse._SubParsersAction[_Parser]) -> None:
    demo = sub.add_parser("demo-model", help="write a random-weight GGUF for offline use")
    demo.add_argument("out", type=Path, help="where to write the .gguf file")
    demo.add_argument("--shape", default="tiny", choices=list(SHAPES))
    demo.add_argument("--quant", default="Q4_K_M", choices=list(QUANTS))
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--tokenizer",
        default="spm",
        choices=list(TOKENIZERS),
        help="spm, spm-space: SentencePiece; gpt2, llama3, qwen2: byte-level BPE;"
        " idefics3: SentencePiece with SmolVLM's image tokens",
    )

    tools = sub.add_parser("tools", help="the MCP servers in settings.toml and their tools")
    tools.add_argument("--json", action="store_true", help="print JSON")
    hw = sub.add_parser("hw", help="this machine (or a given one) and what runs on it")
    hw.add_argument("--json", action="store_true", help="print one JSON object")
    hw.add_argument("--ram", type=_size, help="plan for this much RAM instead (e.g. 16GiB)")
    hw.add_argument("--vram", type=_size, help="plan for a GPU with this much memory (e.g. 6GiB)")
    hw.add_argument("--ctx", type=_positive_int, default=8192, help="wanted context size")
    hw.add_argument("--model-path", type=Path, help="plan for this local GGUF file alone")
    hw.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's speed again (it is measured once, then kept)",
    )

    pull = sub.add_parser("pull", help="download a model from the hub (resumes, verifies)")
    pull.add_argument("model", help="catalog name or org/repo, optionally :QUANT")
    pull.add_argument("--json", action="store_true", help="progress events as JSON lines")
    pull.add_argument(
        "--mmproj",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fetch the repo's vision projector with the model (default: where the repo has"
        " one; --mmproj: it must have one; --no-mmproj: never)",
    )
    models = sub.add_parser("models", help="catalog models, downloads and local files, with fit")
    models.add_argument("--json", action="store_true", help="print JSON")
    models.add_argument("--ctx", type=_positive_int, default=8192, help="context size to fit")
    models.add_argument(
        "--scan",
        metavar="DIR",
        type=Path,
        action="append",
        default=[],
        help="also list the GGUF files in this folder, from now on (repeatable)",
    )
    rm = sub.add_parser("rm", help="delete a downloaded model (or forget an added file)")
    rm.add_argument("model", help="catalog name or org/repo, optionally :QUANT; or an added name")
    rm.add_argument("--mmproj", action="store_true", help="delete the model's vision projector")
    add = sub.add_parser("add", help="register a local GGUF file")
    add.add_argument("path", type=Path)
    add.add_argument("--name", help="the name to list it under (default: the file name)")


def launch_flags(args: argparse.Namespace) -> LaunchOptions:
    """The launch options the flags give (the settings fill the rest: ``Settings.launch``)."""
    return LaunchOptions(
        n_ctx=getattr(args, "ctx", None),
        n_threads=getattr(args, "threads", None),
        template=getattr(args, "template", None),
        kv_type=getattr(args, "kv_type", None),
        speculative=getattr(args, "speculative", None),
        draft_model=getattr(args, "draft_model", None),
        projector=getattr(args, "mmproj", None),
    )
