"""``localchat serve``: the model loaded here, over an OpenAI-compatible API for every tool
on the machine (editors, agents, scripts, another localchat), with the prompt cache on
disk so a restarted server restores what clients resend instead of re-reading it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from localchat.cli.parser import launch_flags
from localchat.errors import UsageError

if TYPE_CHECKING:
    import uvicorn

    from localchat.paths import AppPaths
    from localchat.server.embeddings import EmbeddingModels
    from localchat.server.library_embeddings import LibraryEmbeddings
    from localchat.server.router import Router, ServedEntry
    from localchat.settings import ServeConfig, Settings

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_ENV = "LOCALCHAT_API_KEY"
STOP_GRACE_S = 20  # replies under way get this long to end when the server is stopped


def check_exposure(host: str, api_key: str | None, no_auth: bool) -> None:
    """Binding anything but loopback lets other machines in: only with a key, or when the
    user says plainly that none is wanted."""
    if host not in LOOPBACK and not api_key and not no_auth:
        raise UsageError(
            f"--host {host} lets other machines use the model: give --api-key KEY (or"
            f" {KEY_ENV}), or --no-auth to serve without one"
        )


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class _Endpoint:
    """Where the server listens and the key it asks for (None: none)."""

    host: str
    port: int
    api_key: str | None

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/v1"


def _endpoint(args: argparse.Namespace, config: ServeConfig) -> _Endpoint:
    """The flags over the settings; the key from the flag, else the environment. A host
    open to other machines without a key is refused (``check_exposure``)."""
    host, port = args.host or config.host, args.port or config.port
    key_envs = [e for e in (config.api_key_env, KEY_ENV) if e]
    api_key = args.api_key or next((os.environ[e] for e in key_envs if os.environ.get(e)), None)
    check_exposure(host, api_key, args.no_auth)
    return _Endpoint(host, port, api_key)


def cmd_serve(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.paths import app_paths
    from localchat.server.live import ServerLog
    from localchat.settings import load_settings

    if getattr(args, "server", None):
        raise UsageError("--server chats through another server; serve runs a model here")
    paths = app_paths()
    settings = load_settings(paths.settings_file)
    config = settings.serve
    endpoint = _endpoint(args, config)
    router, embedding, served, states = _router(args, settings, paths)
    embeddings = _embeddings(args, router, embedding)
    server = _http_server(router, endpoint, tuple(args.cors_origin), embeddings)
    print(f"localchat: {served} at {endpoint.url}{states} · Ctrl+C stops", file=out, flush=True)
    log = ServerLog(router, sys.stderr, args.log_format or config.log_format)
    _prepare_to_run()
    try:
        server.run()  # until Ctrl+C or SIGTERM
    finally:
        log.close()
        router.close()
        embeddings.close()
    return 0


def _router(
    args: argparse.Namespace, settings: Settings, paths: AppPaths
) -> tuple[Router, list[ServedEntry], str, str]:
    """The models to serve: those named (the first loaded now, kept loaded), else the
    library's (each loaded on demand), and the library's embedding models; what the banner
    says is served, and of its states."""
    from localchat.models.hardware import detect_hardware
    from localchat.models.library import Library
    from localchat.server.model_source import LibrarySource, library_entries
    from localchat.server.router import FOREVER, Router
    from localchat.state.kvstate import StateStore
    from localchat.units import parse_duration

    config = settings.serve
    named = _named_entries(args)
    embedding: list[ServedEntry] = []
    if not named and args.alias:
        raise UsageError("--alias names another name for a model --model (or --model-path)"
                         " gives; with neither, serve serves the library under its own names")  # fmt: skip
    if not named:
        named, embedding = library_entries(Library(paths, detect_hardware()))
        if not named:  # nothing downloaded yet: the starter model
            named = _named_entries(args, starter=True)
    if args.draft_model or args.speculative == "draft":
        print("localchat: serve drafts by prompt lookup only (a draft model is not used"
              " there yet)", file=sys.stderr)  # fmt: skip
    flags = replace(launch_flags(args), n_ctx=args.ctx or config.ctx,
                    speculative="ngram" if args.speculative == "draft" else args.speculative)  # fmt: skip
    states = StateStore(paths.states_dir, settings.state_budget_bytes)
    source = LibrarySource(paths, settings.launch(flags), states, args.parallel or config.parallel,
                           warn=lambda line: print(f"localchat: {line}", file=sys.stderr))  # fmt: skip
    keep_alive = parse_duration(args.keep_alive or config.keep_alive)
    library = not (args.model or args.model_path)
    router = Router(named, source, keep_alive, args.max_models or config.max_models,
                    any_name=len(named) == 1, default=None if library else named[0].name)  # fmt: skip
    if library and len(named) > 1:
        return router, embedding, f"serving {len(named)} models, each loaded when asked for", ""
    runner = source.load(named[0])
    router.adopt(named[0].name, runner, keep_alive_s=FOREVER)
    back = runner.restore_newest()  # the conversations answered last continue from memory
    more = f" (and {len(named) - 1} more on demand)" if len(named) > 1 else ""
    served = (
        f"serving {named[0].name} (context {runner.batch.n_ctx_seq} × {runner.parallel}"
        f" sequence{'s' if runner.parallel != 1 else ''}){more}"
    )
    states_line = f" · {len(runner.cache)} saved prompt states ({back} back in memory)"
    return router, embedding, served, states_line


def _embeddings(
    args: argparse.Namespace, router: Router, library: list[ServedEntry]
) -> LibraryEmbeddings:
    """Who answers the embeddings endpoints: ``--embedding-model`` (a file, or a catalog or
    hub name, downloaded if needed) and the library's embedding models, the first the
    default; any chat model served, mean-pooled. Each loaded at its first request."""
    from localchat.cli.ask import pull_model_path
    from localchat.server.library_embeddings import LibraryEmbeddings
    from localchat.server.router import ServedEntry

    given = getattr(args, "embedding_model", None)
    first = []
    if given:
        path = Path(given).expanduser()
        found = path if path.is_file() else pull_model_path(given)
        first = [ServedEntry(given, found, unlisted=(found.stem,))]
    return LibraryEmbeddings(first + library, router)


def _named_entries(args: argparse.Namespace, starter: bool = False) -> list[ServedEntry]:
    """The models the flags name (files, then names; the aliases go with the first), or
    the starter model."""
    from localchat.cli.ask import resolve_model_path
    from localchat.gguf.names import display_name
    from localchat.server.router import ServedEntry

    asked: list[tuple[str | None, Path | None]] = [(None, Path(p)) for p in args.model_path]
    asked += [(name, None) for name in args.model]
    if starter:
        asked = [(None, None)]
    entries = []
    for index, (name, path) in enumerate(asked):
        one = argparse.Namespace(model=name, model_path=path)
        found = resolve_model_path(one)
        aliases = tuple(args.alias) if index == 0 else ()
        # Served under the name users know it by; the file's stem (the name before) is
        # still answered (not listed), so a client that sends it is answered under it.
        unlisted = () if name else (found.stem,)
        entries.append(ServedEntry(name or display_name(found), found, aliases, unlisted))
    return entries


def _http_server(
    models: Router,
    endpoint: _Endpoint,
    cors_origins: tuple[str, ...],
    embeddings: EmbeddingModels | None = None,
) -> uvicorn.Server:
    """The API over the models, served by uvicorn (replies under way get ``STOP_GRACE_S``
    to end when it is stopped)."""
    import uvicorn

    from localchat.server.app import create_app

    app = create_app(
        models, endpoint.api_key, loopback=endpoint.host in LOOPBACK, cors_origins=cors_origins,
        embeddings=embeddings,
    )  # fmt: skip
    config = uvicorn.Config(
        app,
        endpoint.host,
        endpoint.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=STOP_GRACE_S,
    )
    return uvicorn.Server(config)


def _prepare_to_run() -> None:
    """What a server run needs first: SIGTERM ending it as a service's, and anyio's backend
    loaded."""
    import anyio

    # uvicorn stops on SIGINT and SIGTERM itself, then hands the signal back: Ctrl+C ends as
    # any command's (130), SIGTERM as a service's (143) — both after the saves under way.
    signal.signal(signal.SIGTERM, _terminated)
    # anyio loads its event-loop backend on first use (~25 ms here): now, not inside the
    # first request's time (a restarted server's first request is the one that matters).
    anyio.run(anyio.sleep, 0)
