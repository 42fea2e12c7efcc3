"""The ``ask`` command: one headless turn through the session, streamed to stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from localchat.chat.attachments import check_fits, read_attachment, with_attachments
from localchat.chat.image_files import is_image_path, read_image_file
from localchat.cli.interrupt import EXIT_INTERRUPTED
from localchat.cli.models import default_model, library, pull
from localchat.cli.parser import EXIT_USAGE, launch_flags
from localchat.errors import UsageError
from localchat.paths import app_paths
from localchat.text import printable

if TYPE_CHECKING:
    from localchat.backends.base import Backend, Reply, TokenDelta
    from localchat.chat.template import ChatMessage
    from localchat.chat.tools import ToolUse
    from localchat.cli.tool_loop import AskReplies
    from localchat.session import Session
    from localchat.settings import Settings
    from localchat.tools.loop import CallRecord

# The flags that say how a local model runs: a server decides that itself.
LOCAL_ONLY_FLAGS = (
    "model_path",
    "template",
    "kv_type",
    "threads",
    "speculative",
    "draft_model",
    "mmproj",
)


def cmd_ask(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.cli.tool_loop import AskHooks
    from localchat.models.speed_feedback import note_turn_speed
    from localchat.session import Session
    from localchat.settings import load_settings
    from localchat.tools.consent import Consent
    from localchat.tools.loop import ToolLoop, chain

    _read_message(args)
    settings = load_settings(app_paths().settings_file)
    if args.server:
        _refuse_local_flags(args)
    model_path = None if args.server else resolve_model_path(args)
    cancel = threading.Event()
    session = Session(app_paths(), settings, open_stores=bool(args.conversation))
    loop = ToolLoop(AskHooks(session, Consent(set(args.allow_tool), args.yes)), cancel)
    try:  # the session frees the backend, however the turn ends
        backend = _backend(args, session, model_path)
        session.use(backend)
        replies = _replies(args, session, settings, cancel)
        interrupted = False
        for turn in chain(loop, replies, replies.first()):
            interrupted = _stream(turn, args, cancel, out)
        notices = list(turn.notices)
        save_error = replies.wait_saved()
        speed = note_turn_speed(session.paths, backend, turn.generation.stats)
        notices += [notice for notice in (save_error, speed) if notice]
        stats = turn.stats_dict()
        _print_result(out, args, turn.generation, backend, stats, notices, loop.records)
    finally:
        session.close()
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_USAGE if loop.refused else 0


def _read_message(args: argparse.Namespace) -> None:
    """The message, with the attached files' text: from the arguments or stdin."""
    if args.fresh and not args.conversation:
        raise UsageError("--fresh needs --conversation NAME (a one-off ask has no saved state)")
    args.message = _message_text(args.message, sys.stdin)
    pictures = [*args.image, *(path for path in args.attach if is_image_path(path))]
    args.attachments = [read_attachment(p) for p in args.attach if p not in pictures]
    args.message = with_attachments(args.message, args.attachments)
    args.pictures = [read_image_file(path) for path in pictures]  # checked, nothing stored


def _replies(
    args: argparse.Namespace, session: Session, settings: Settings, cancel: threading.Event
) -> AskReplies:
    """Where the ask's replies come from: the conversation named (opened, and offered the
    tools), else a one-off exchange. Refuses a message the context cannot hold first."""
    from localchat.backends.base import Sampling
    from localchat.cli.tool_loop import ConversationReplies, OneOffReplies
    from localchat.state.kvstate import StateStore

    temperature = settings.temperature if args.temperature is None else args.temperature
    sampling = Sampling(temperature=temperature, seed=args.seed)
    max_tokens = args.max_tokens or settings.max_tokens
    backend = session.backend
    assert backend is not None
    _report_attachments(args, backend.count_tokens, backend.context_size, max_tokens)
    images = _stored_images(args, backend, session)
    tool_use = _tool_use(args, session)
    if not args.conversation:
        messages = _one_off_messages(args, images)
        states = session.states or StateStore(session.paths.states_dir, settings.state_budget_bytes)
        return OneOffReplies(
            backend,
            states,
            settings.prefix_state_min_tokens,
            messages,
            sampling,
            max_tokens,
            cancel,
            tool_use,
        )
    conversation = session.open_conversation(args.conversation, args.system, args.wait, args.window)
    assert conversation is not None  # a backend and a database: it opens or raises
    if tool_use != conversation.tool_use:  # it was offered the default choice
        conversation.offer_tools(tool_use)
    return ConversationReplies(
        conversation, sampling, max_tokens, cancel, args.message, args.fresh, images
    )


def _stored_images(args: argparse.Namespace, backend: Backend, session: Session) -> tuple[str, ...]:
    """The images shown, stored once the model is known to read them (nothing kept else)."""
    from localchat.conversation.images import stored_images

    return stored_images(backend, session.paths.images_dir, args.pictures)


def _tool_use(args: argparse.Namespace, session: Session) -> ToolUse | None:
    """Start the MCP servers (a line for each that cannot) and say which tools the replies
    are offered."""
    for problem in session.start_tools():
        print(f"localchat: {problem}", file=sys.stderr)
    return session.tools.use(args.tool_choice)


def _refuse_local_flags(args: argparse.Namespace) -> None:
    """``ask --server`` with flags only a local model takes: refused, each named."""
    ignored = [f for f in LOCAL_ONLY_FLAGS if getattr(args, f, None)]
    if ignored or args.fresh:
        names = ", ".join(
            "--" + f.replace("_", "-") for f in ignored + (["fresh"] if args.fresh else [])
        )
        raise UsageError(f"{names} choose how a local model runs; with --server the server decides")


def resolve_model_path(args: argparse.Namespace) -> Path:
    """The local model to load: the file given, a catalog or hub model (downloaded if
    needed), else the starter model."""
    if args.model_path is not None:
        return Path(args.model_path)
    if args.model:
        return pull_model_path(args.model)
    return default_model()


def pull_model_path(name: str) -> Path:
    """A catalog or hub model's file, downloaded if it is not here yet."""
    models = library()
    request = models.request(name)
    return models.path_of(request) or pull(models, request, json_lines=False)[0]


def _backend(args: argparse.Namespace, session: Session, model_path: Path | None) -> Backend:
    """What answers: the server asked for, else the model loaded here (on this thread, which
    evaluates it; kv_type and threads default to the settings)."""
    if model_path is None:
        from localchat.backends.servers import connect

        return connect(session.settings.server(args.server), args.model, args.ctx)
    from localchat.models.loader import ModelLoader

    return ModelLoader(session.paths).load(
        model_path,
        session.settings.launch(launch_flags(args)),
        warn=lambda line: print(f"localchat: {line}", file=sys.stderr),
        on_this_thread=True,
    )


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


def _one_off_messages(args: argparse.Namespace, images: tuple[str, ...]) -> list[ChatMessage]:
    """A one-off ask's messages: the system prompt if given, then the user's."""
    from localchat.chat.template import ChatMessage

    messages = [ChatMessage("system", args.system)] if args.system else []
    messages.append(ChatMessage("user", args.message, images=images))
    return messages


def _stream(
    deltas: Iterable[TokenDelta], args: argparse.Namespace, cancel: threading.Event, out: TextIO
) -> bool:
    """Write deltas to ``out`` (unless --json): the answer to ``out``, a reasoning model's
    thinking to stderr (dimmed on a terminal). Returns True if Ctrl-C stopped the reply."""
    safe = out.isatty()
    dim = sys.stderr.isatty()
    stream = iter(deltas)
    wrote = False  # a reply that only calls tools writes no line of its own
    try:
        for delta in stream:
            if args.json:
                continue
            if delta.reasoning:
                text = printable(delta.text) if dim else delta.text
                sys.stderr.write(f"\x1b[2m{text}\x1b[0m" if dim else text)
                sys.stderr.flush()
                continue
            if delta.text:
                out.write(printable(delta.text) if safe else delta.text)
                out.flush()
                wrote = True
    except KeyboardInterrupt:
        cancel.set()
        _close_after_interrupt(stream)
        return True
    if wrote:
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
    calls: list[CallRecord],
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
        if calls:
            payload["tool_calls"] = [record.as_json() for record in calls]
        if notices:
            payload["notices"] = notices
        out.write(json.dumps(payload, ensure_ascii=False) + "\n")
