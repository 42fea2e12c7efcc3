"""The ``localchat`` command: the app by default, headless subcommands for everything else.

Every error ends as one line on stderr, never a traceback: exit code 2 for the user's
mistakes, 1 when the network, a server or the disk failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from localchat import __version__
from localchat.chat.attachments import check_fits, read_attachment, with_attachments
from localchat.errors import LocalchatError, UsageError, WorldError, one_line
from localchat.models.demo import (
    QUANTS,
    SHAPES,
    TOKENIZERS,
    ensure_demo_model,
    make_demo_model,
)
from localchat.paths import app_paths
from localchat.progress import StepProgress
from localchat.text import printable

if TYPE_CHECKING:
    from localchat.backends.base import Backend, Reply, Sampling, TokenDelta, TurnStats
    from localchat.backends.llama.engine import Engine
    from localchat.chat.template import ChatMessage
    from localchat.models.hub import Progress
    from localchat.models.library import Library
    from localchat.settings import Settings
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

EXIT_USAGE = 2  # the user's mistake: a bad flag, an unknown name, an unusable file
EXIT_WORLD = 1  # the world failed: network, server, disk
EXIT_INTERRUPTED = 130

# The model used when none is named and nothing has been downloaded: generated offline.
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="localchat", description="Chat with quantized local LLMs.")
    parser.add_argument("--version", action="version", version=f"localchat {__version__}")
    parser.add_argument(
        "--demo", action="store_true", help="open the app on the offline demo model"
    )
    _model_flags(parser)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    ask = sub.add_parser("ask", help="one headless turn: stream a reply to stdout")
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
        help="put a text file (code, Markdown, logs) into the message, under its name; repeatable",
    )
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
    ask.add_argument(
        "--kv-type",
        default=None,
        choices=["f16", "q8_0", "q4_0"],
        help="KV cache type (default: the kv_type setting); q8_0 halves memory and state files",
    )
    ask.add_argument("--threads", type=_positive_int, default=None, help="CPU threads")
    ask.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming"
    )
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
    ask.add_argument(
        "--window",
        choices=["auto", "shift", "exact"],
        default=None,
        help="when old messages leave the context: shift the cache in place (auto: where safe)"
        " or re-evaluate the window exactly (default: the window_mode setting)",
    )

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

    demo = sub.add_parser("demo-model", help="write a random-weight GGUF for offline use")
    demo.add_argument("out", type=Path, help="where to write the .gguf file")
    demo.add_argument("--shape", default="tiny", choices=list(SHAPES))
    demo.add_argument("--quant", default="Q4_K_M", choices=list(QUANTS))
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--tokenizer",
        default="spm",
        choices=list(TOKENIZERS),
        help="spm, spm-space: SentencePiece; gpt2, llama3, qwen2: byte-level BPE",
    )

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
        "--mmproj", action="store_true", help="also fetch the repo's vision projector for it"
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
        " plan, memory, remote, zerowait, branch, calibrate",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def default_model() -> Path:
    """The starter model (SmolLM2-135M-Instruct, fetched once), else a generated one."""
    from localchat.models.starter import ensure_starter

    with download_progress() as draw:
        choice = ensure_starter(app_paths(), draw)
    print(f"localchat: {choice.note or f'no model given: {choice.path.name}'}", file=sys.stderr)
    return choice.path


def cmd_ask(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.backends.base import Sampling
    from localchat.backends.llama.engine import Engine, LoadOptions
    from localchat.settings import load_settings

    if args.fresh and not args.conversation:
        raise UsageError("--fresh needs --conversation NAME (a one-off ask has no saved state)")
    args.message = _message_text(args.message, sys.stdin)
    args.attachments = [read_attachment(path) for path in args.attach]
    args.message = with_attachments(args.message, args.attachments)
    if args.server:
        return _ask_remote(args, out, load_settings(app_paths().settings_file))
    model_path = args.model_path
    if model_path is None and args.model:
        model_path = _library().path_of(args.model) or _pull(args.model, json_lines=False)[0]
    if model_path is None:
        model_path = default_model()
    from localchat.models.catalog import catalog_template

    settings = load_settings(app_paths().settings_file)
    kv_type = args.kv_type or settings.kv_type
    template = args.template or catalog_template(model_path, app_paths().user_catalog)
    engine = Engine(
        model_path,
        LoadOptions(
            n_ctx=args.ctx,
            n_threads=args.threads,
            kv_type=kv_type,
            template=template,
            swa_cache=settings.swa_cache,
        ),
    )
    temperature = settings.temperature if args.temperature is None else args.temperature
    sampling = Sampling(temperature=temperature, seed=args.seed)
    if args.max_tokens is None:
        args.max_tokens = settings.max_tokens
    cancel = threading.Event()
    try:
        _report_attachments(args, engine.count_tokens, engine.n_ctx, args.max_tokens)
        if args.conversation:
            return _ask_in_conversation(args, engine, sampling, cancel, out, settings)
        return _ask_once(args, engine, sampling, cancel, out, settings)
    finally:
        engine.close()


def _report_attachments(
    args: argparse.Namespace, count: Callable[[str], int], n_ctx: int | None, max_tokens: int
) -> None:
    """Each attached file's token cost (stderr); a message the context cannot hold is refused
    before anything is stored."""
    if not args.attachments:
        return
    for attachment in args.attachments:
        print(
            f"localchat: attached {attachment.name}: {count(attachment.block()):,} tokens",
            file=sys.stderr,
        )
    head = count(args.system) if args.system else 0
    check_fits(args.attachments, count(args.message), head, n_ctx, max_tokens)


def _message_text(message: str | None, stdin: TextIO) -> str:
    """The message: as given, or read from stdin for ``-`` or when none is given."""
    if message is not None and message != "-":
        return message
    if message is None and stdin.isatty():
        raise UsageError('no message: give one (`localchat ask "hi"`) or pipe it in')
    text = stdin.read()
    if not text.strip():
        raise UsageError("the message read from stdin is empty")
    return text.rstrip("\n")


def _stream(
    deltas: Iterable[TokenDelta], args: argparse.Namespace, cancel: threading.Event, out: TextIO
) -> bool:
    """Write deltas to ``out`` (unless --json): the answer to ``out``, a reasoning model's
    thinking to stderr (dimmed on a terminal). Returns True if Ctrl-C stopped the reply."""
    safe = out.isatty()
    dim = sys.stderr.isatty()
    stream = iter(deltas)
    try:
        for delta in stream:
            if args.json:
                continue
            if delta.reasoning:
                text = printable(delta.text) if dim else delta.text
                sys.stderr.write(f"\x1b[2m{text}\x1b[0m" if dim else text)
                sys.stderr.flush()
                continue
            out.write(printable(delta.text) if safe else delta.text)
            out.flush()
    except KeyboardInterrupt:
        cancel.set()
        _close_after_interrupt(stream)
        return True
    if not args.json:
        out.write("\n")
    return False


def _close_after_interrupt(stream: Iterator[TokenDelta]) -> None:
    """End an interrupted reply here, not when the stream is garbage: its cleanup (the partial
    reply committed, the cache held) then runs now, and a ``KeyboardInterrupt`` it raises (the
    engine evaluates nothing after Ctrl+C) is not printed as "Exception ignored"."""
    close = getattr(stream, "close", None)
    if close is not None:
        with contextlib.suppress(KeyboardInterrupt):
            close()


def _print_result(
    out: TextIO,
    args: argparse.Namespace,
    generation: Reply,
    backend: Backend,
    stats: dict[str, Any],
    notices: list[str],
) -> None:
    for notice in notices:
        print(f"localchat: notice: {notice}", file=sys.stderr)
    if args.json:
        view = backend.describe()
        payload = {
            "reply": generation.answer,
            "reasoning": generation.reasoning or None,
            "conversation": args.conversation,
            "model": view.model,
            "template": view.template,  # None: a server renders its own and does not say
            "n_ctx": backend.context_size,
            "server": view.server,
            "stats": stats,
        }
        if notices:
            payload["notices"] = notices
        out.write(json.dumps(payload, ensure_ascii=False) + "\n")


def _ask_once(
    args: argparse.Namespace,
    engine: Engine,
    sampling: Sampling,
    cancel: threading.Event,
    out: TextIO,
    settings: Settings,
) -> int:
    """One turn with no conversation; a known long system prompt starts from its saved state."""
    from localchat.conversation.local import RestoreReport, turn_stats_dict
    from localchat.conversation.prefix_states import prefix_spans, start_from_prefix
    from localchat.state.kvstate import StateStore

    messages = _one_off_messages(args)
    builder = engine.prompt_builder()
    prompt = builder.build(messages)
    prefix = start_from_prefix(
        engine,
        StateStore(app_paths().states_dir, settings.state_budget_bytes),
        engine.state_key,
        prompt.tokens,
        prefix_spans(builder, messages, prompt, len(messages) - 1),
        settings.prefix_state_min_tokens,
    )
    restore = RestoreReport.from_prefix(prefix)
    generation = engine.generate(prompt.tokens, sampling, args.max_tokens, cancel)
    interrupted = _stream(generation, args, cancel, out)
    notices = _speed_notices(engine, generation.stats)
    stats = turn_stats_dict(generation.stats, restore)
    _print_result(out, args, generation, engine, stats, notices)
    return EXIT_INTERRUPTED if interrupted else 0


def _speed_notices(engine: Engine, stats: TurnStats) -> list[str]:
    """The turn's speed counted against the calibration: a notice if it was corrected."""
    from localchat.session import note_turn_speed

    notice = note_turn_speed(app_paths(), engine, stats)
    return [notice] if notice else []


def _one_off_messages(args: argparse.Namespace) -> list[ChatMessage]:
    """A one-off ask's messages: the system prompt if given, then the user's."""
    from localchat.chat.template import ChatMessage

    messages = [ChatMessage("system", args.system)] if args.system else []
    messages.append(ChatMessage("user", args.message))
    return messages


def _ask_in_conversation(
    args: argparse.Namespace,
    engine: Engine,
    sampling: Sampling,
    cancel: threading.Event,
    out: TextIO,
    settings: Settings,
) -> int:
    from localchat.conversation.local import Conversation
    from localchat.session import Session

    session = Session(app_paths(), settings, engine)
    try:
        conversation = session.open_conversation(
            args.conversation, args.system, args.wait, args.window or settings.window_mode
        )
        assert isinstance(conversation, Conversation)  # a local model: it opens or raises
        turn = conversation.send(args.message, sampling, args.max_tokens, cancel, fresh=args.fresh)
        interrupted = _stream(turn, args, cancel, out)
        conversation.saver.wait()
        notices = list(turn.notices)
        if conversation.saver.last_error:
            notices.append(conversation.saver.last_error)
        notices += _speed_notices(engine, turn.generation.stats)
        _print_result(out, args, turn.generation, engine, turn.stats_dict(), notices)
    finally:
        session.close(free_backend=False)  # the caller frees the model
    return EXIT_INTERRUPTED if interrupted else 0


def _ask_remote(args: argparse.Namespace, out: TextIO, settings: Settings) -> int:
    """``ask --server``: the same turn, answered by a server; the transcript stays here."""
    from localchat.backends.base import Sampling
    from localchat.conversation.local import turn_stats_dict
    from localchat.session import Session, connect

    ignored = [
        f for f in ("model_path", "template", "kv_type", "threads") if getattr(args, f, None)
    ]
    if ignored or args.fresh:
        names = ", ".join(
            "--" + f.replace("_", "-") for f in ignored + (["fresh"] if args.fresh else [])
        )
        raise UsageError(f"{names} choose how a local model runs; with --server the server decides")
    backend = connect(settings, args.server, args.model, args.ctx)
    temperature = settings.temperature if args.temperature is None else args.temperature
    sampling = Sampling(temperature=temperature, seed=args.seed)
    max_tokens = args.max_tokens or settings.max_tokens
    cancel = threading.Event()
    try:
        _report_attachments(args, backend.count_tokens, backend.context_size, max_tokens)
    except BaseException:
        backend.close()
        raise
    if not args.conversation:
        try:
            reply = backend.stream(_one_off_messages(args), sampling, max_tokens, cancel)
            interrupted = _stream(reply, args, cancel, out)
            _print_result(out, args, reply, backend, turn_stats_dict(reply.stats), [])
        finally:
            backend.close()
        return EXIT_INTERRUPTED if interrupted else 0
    session = Session(app_paths(), settings, backend)
    try:
        conversation = session.open_conversation(args.conversation, args.system, args.wait)
        assert conversation is not None  # a backend and a database: it opens or raises
        turn = conversation.send(args.message, sampling, max_tokens, cancel)
        interrupted = _stream(turn, args, cancel, out)
        _print_result(out, args, turn.generation, backend, turn.stats_dict(), list(turn.notices))
    finally:
        session.close()
    return EXIT_INTERRUPTED if interrupted else 0


def _open_store(settings: Settings | None = None) -> tuple[Store, StateStore]:
    from localchat.settings import load_settings
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    paths = app_paths()
    settings = settings or load_settings(paths.settings_file)
    return Store(paths.database), StateStore(paths.states_dir, settings.state_budget_bytes)


def cmd_conversations(args: argparse.Namespace, out: TextIO) -> int:
    store, _states = _open_store()
    try:
        records = store.conversations()
    finally:
        store.close()
    if args.json:
        rows = [
            {
                "name": r.name,
                "title": r.title,
                "messages": r.message_count,
                "model": r.model,
                "created_at": r.created_at,
                "updated_at": r.updated_at,
            }
            for r in records
        ]
        out.write(json.dumps(rows, indent=2) + "\n")
        return 0
    if not records:
        out.write(
            "no conversations yet; start one with: localchat ask --conversation NAME MESSAGE\n"
        )
    for r in records:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated_at))
        out.write(f"{r.name}\t{r.message_count} messages\t{when}\t{r.model or '-'}\n")
    return 0


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.state.export import export_conversation

    store, _states = _open_store()
    try:
        record = store.get(args.name)
        messages = store.messages(record.id)
        tree = store.all_messages(record.id)
    finally:
        store.close()
    out.write(export_conversation(record, messages, args.format, args.reasoning, tree))
    return 0


def cmd_branch(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.conversation.local import fork_conversation

    store, states = _open_store()
    try:
        fork, caches = fork_conversation(store, states, args.name, args.at, args.new_name)
    finally:
        store.close()
    start = (
        "its first turn starts from the saved cache of the shared part"
        if caches
        else "no saved cache to start from: its first turn reads the conversation"
    )
    out.write(f"branched {args.name!r} at message {args.at} into {fork.name!r} ({start})\n")
    return 0


def cmd_rm_conversation(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.conversation.local import delete_conversation

    store, states = _open_store()
    try:
        name = delete_conversation(store, states, args.name)
    finally:
        store.close()
    out.write(f"deleted conversation {name!r}\n")
    return 0


def cmd_hw(args: argparse.Namespace, out: TextIO) -> int:
    from dataclasses import replace

    from localchat.models.catalog import load_catalog
    from localchat.models.hardware import GPU_NONE, GPU_NVIDIA, detect_hardware
    from localchat.models.planner import (
        format_hardware_report,
        hardware_json,
        plan_catalog,
        plan_file,
    )

    hardware = detect_hardware()
    if args.ram is not None:
        hardware = replace(
            hardware, ram_total_bytes=args.ram, ram_available_bytes=args.ram, notes=()
        )
    if args.vram is not None:
        # A given GPU is a question about that machine: assume a GPU build of llama.cpp.
        hardware = replace(
            hardware,
            vram_total_bytes=args.vram,
            vram_free_bytes=args.vram,
            gpu=GPU_NVIDIA if args.vram else GPU_NONE,
            gpu_name="given GPU" if args.vram else "",
            gpu_offload=bool(args.vram),
            notes=(),
        )
    from localchat.models.calibrate import CalibrationUnsettled, speed_model
    from localchat.settings import load_settings

    min_tps = load_settings(app_paths().settings_file).min_tokens_per_s
    unsettled = None
    with step_progress(sys.stderr) as draw:
        try:
            speed = speed_model(app_paths(), draw, again=args.calibrate)
        except CalibrationUnsettled as exc:  # nothing saved: plans by memory this time
            unsettled, speed = exc, None
    if unsettled is not None:  # on its own line, after the progress bar's
        print(f"localchat: {unsettled}", file=sys.stderr)
    if args.model_path is not None:
        plans = [plan_file(args.model_path, hardware, args.ctx, speed, min_tps)]
    else:
        catalog = load_catalog(app_paths().user_catalog)
        plans = plan_catalog(catalog, hardware, args.ctx, speed, min_tps)
    if args.json:
        payload = {"hardware": hardware_json(hardware), "plans": [plan.as_json() for plan in plans]}
        out.write(json.dumps(payload, indent=2) + "\n")
        return 0
    out.write(format_hardware_report(hardware, plans))
    return 0


def _library() -> Library:
    from localchat.models.hardware import detect_hardware
    from localchat.models.library import Library
    from localchat.settings import load_settings

    min_tps = load_settings(app_paths().settings_file).min_tokens_per_s
    return Library(app_paths(), detect_hardware(), min_tps=min_tps)


def _pull(
    model: str, json_lines: bool, out: TextIO | None = None, projector: bool = False
) -> list[Path]:
    """Download ``model`` with progress on stderr: a redrawn line on a terminal, plain lines
    otherwise, or JSON lines on ``out``. Ctrl-C stops it (the next pull resumes)."""
    cancel = threading.Event()
    with download_progress(json_lines, out) as draw:
        try:
            library = _library()
            wanted = library.projector_for(model) if projector else None  # refused first
            paths = [library.pull(model, draw, cancel)]
            if wanted is not None:
                paths.append(library.pull_projector(wanted, draw, cancel))
            return paths
        except KeyboardInterrupt:
            cancel.set()
            raise


@contextlib.contextmanager
def download_progress(
    json_lines: bool = False, out: TextIO | None = None
) -> Iterator[Callable[[Progress], None]]:
    """A download's progress on stderr: a redrawn line on a terminal, plain lines otherwise,
    or JSON lines on ``out``."""
    terminal = sys.stderr.isatty()
    last: dict[str, Any] = {"at": 0.0, "state": None, "drawn": False}

    def draw(progress: Progress) -> None:
        now = time.monotonic()
        changed = progress.state != last["state"]
        if not changed and now - last["at"] < (0.2 if terminal or json_lines else 2.0):
            return
        last.update(at=now, state=progress.state, drawn=True)
        if json_lines and out is not None:
            event = {
                "event": progress.state,
                "name": progress.name,
                "bytes_done": progress.bytes_done,
                "bytes_total": progress.bytes_total,
                "bytes_per_s": round(progress.speed, 1),
                "eta_s": None if progress.eta_s is None else round(progress.eta_s, 1),
            }
            out.write(json.dumps(event) + "\n")
            out.flush()
        elif terminal:
            sys.stderr.write(f"\r{progress.name}: {progress.summary()}   ")
            sys.stderr.flush()
        else:
            sys.stderr.write(f"{progress.name}: {progress.summary()}\n")
            sys.stderr.flush()

    try:
        yield draw
    finally:
        if last["drawn"] and terminal and not json_lines:
            sys.stderr.write("\n")


def cmd_pull(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.models.hub import DownloadCancelled

    try:
        paths = _pull(args.model, args.json, out, args.mmproj)
    except KeyboardInterrupt:
        sys.stderr.write("localchat: download stopped; run the same pull again to resume\n")
        return EXIT_INTERRUPTED
    except DownloadCancelled as exc:
        sys.stderr.write(f"localchat: {exc}\n")
        return EXIT_INTERRUPTED
    for path in paths:
        if args.json:
            out.write(json.dumps({"event": "done", "path": str(path)}) + "\n")
        else:
            out.write(f"{path}\n")
    return 0


def cmd_models(args: argparse.Namespace, out: TextIO) -> int:
    from dataclasses import asdict

    from localchat.units import format_bytes

    library = _library()
    for folder in args.scan:
        library.add_scan_dir(folder)
    rows = library.rows(args.ctx)
    if args.json:
        out.write(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        return 0
    out.write(
        f"{'MODEL':28} {'QUANT':10} {'SIZE':>10} {'NEEDS':>10} {'SPEED':>9} {'FIT':8} DOWNLOADED\n"
    )
    for r in rows:
        needs = format_bytes(r.estimated_bytes) if r.estimated_bytes else "-"
        speed = f"~{r.predicted_gen_tps:.0f} t/s" if r.predicted_gen_tps else "-"
        quant = f"{r.quant}*" if r.planned else r.quant
        mark = "yes" if r.downloaded else ""
        if r.source != "catalog":
            mark = f"{r.source}: {r.path}"
        if r.problem:
            mark += f" — unusable: {r.problem}"
        out.write(
            f"{r.model[:28]:28} {quant:10} {format_bytes(r.size_bytes):>10} {needs:>10}"
            f" {speed:>9} {r.fit:8} {mark}\n"
        )
    if any(r.planned for r in rows):
        out.write("* the planner's pick for this machine (speed: predicted tokens/s here)\n")
    return 0


def cmd_rm(args: argparse.Namespace, out: TextIO) -> int:
    removed = _library().remove(args.model, args.mmproj)
    out.write(f"removed {args.model} ({len(removed)} files)\n")
    return 0


def cmd_add(args: argparse.Namespace, out: TextIO) -> int:
    out.write(_library().add_local(args.path, args.name) + "\n")
    return 0


def cmd_demo_model(args: argparse.Namespace, out: TextIO) -> int:
    path = make_demo_model(args.out, args.shape, args.quant, args.seed, tokenizer=args.tokenizer)
    out.write(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.shape}, {args.quant}, seed {args.seed})\n"
    )
    return 0


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.bench.run import PARTS, format_report, run_bench

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
    from localchat.cli import interrupt
    from localchat.tui.app import run_app

    interrupt.uninstall()  # the app handles Ctrl+C as a key, and its loop the signal
    return run_app(
        args.model_path,
        n_ctx=args.ctx,
        model_name=args.model,
        demo=args.demo,
        template=args.template,
        server=args.server,
    )


@contextlib.contextmanager
def step_progress(stream: TextIO) -> Iterator[Callable[[StepProgress], None]]:
    """A progress bar for a long step (calibration, a first start): one redrawn line on a
    terminal, else a plain line whenever the detail changes."""
    terminal = stream.isatty()
    last: dict[str, Any] = {"detail": "", "at": 0.0, "drawn": False}

    def draw(progress: StepProgress) -> None:
        now = time.monotonic()
        if terminal and now - last["at"] >= 0.1:
            filled = round(20 * progress.fraction)
            stream.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] {progress.line()}\x1b[K")
        elif not terminal and progress.detail != last["detail"]:
            stream.write(f"localchat: {progress.line()}\n")
        else:
            return
        stream.flush()
        last.update(detail=progress.detail, at=now, drawn=True)

    try:
        yield draw
    finally:
        if terminal and last["drawn"]:
            stream.write("\n")
            stream.flush()


def _progress(stream: TextIO, label: str = "bench") -> Callable[[str], None]:
    def report(line: str) -> None:
        stream.write(f"{label}: {line}\n")
        stream.flush()

    return report


COMMANDS: dict[str | None, Callable[[argparse.Namespace, TextIO], int]] = {
    "ask": cmd_ask,
    "demo-model": cmd_demo_model,
    "bench": cmd_bench,
    "hw": cmd_hw,
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
