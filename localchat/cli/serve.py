"""``localchat serve``: the model loaded here, over an OpenAI-compatible API for every tool
on the machine (editors, agents, scripts, another localchat), with the prompt cache on
disk so a restarted server restores what clients resend instead of re-reading it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from localchat.errors import UsageError

if TYPE_CHECKING:
    import uvicorn

    from localchat.backends.llama.engine import Engine
    from localchat.server.embeddings import EmbeddingModels, OneEmbedder
    from localchat.server.runner import ModelRunner
    from localchat.session import Session
    from localchat.settings import ServeConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_ENV = "LOCALCHAT_API_KEY"
STOP_GRACE_S = 20  # replies under way get this long to end when the server is stopped
OWN_CELLS = 256  # the engine's own context: it only warms the model up


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
    from localchat.cli.ask import resolve_model_path
    from localchat.models.hardware import detect_hardware
    from localchat.paths import app_paths
    from localchat.server.live import ServerLog
    from localchat.server.runner import ModelRunner, default_parallel
    from localchat.session import Session
    from localchat.settings import load_settings
    from localchat.state.kvstate import StateStore

    if getattr(args, "server", None):
        raise UsageError("--server chats through another server; serve runs a model here")
    paths = app_paths()
    settings = load_settings(paths.settings_file)
    config = settings.serve
    endpoint = _endpoint(args, config)
    model_path = resolve_model_path(args)
    engine = _load_engine(Session(paths, settings, open_stores=False), args, config, model_path)
    name = args.model or Path(model_path).stem
    parallel = args.parallel or config.parallel
    if parallel is None:
        parallel = default_parallel(engine, detect_hardware().ram_available_bytes)
    states = StateStore(paths.states_dir, settings.state_budget_bytes)
    runner = ModelRunner(engine, states, name, parallel=parallel, aliases=tuple(args.alias))
    back = runner.restore_newest()  # the conversations answered last continue from memory
    embedders = _embedders(args, model_path, runner.names)
    server = _http_server(runner, endpoint, tuple(args.cors_origin), embedders)
    print(
        f"localchat: serving {name} (context {runner.batch.n_ctx_seq} × {parallel}"
        f" sequence{'s' if parallel != 1 else ''}) at {endpoint.url}"
        f" · {len(runner.cache)} saved prompt states ({back} back in memory) · Ctrl+C stops",
        file=out,
        flush=True,
    )
    log = ServerLog(runner, sys.stderr, args.log_format or config.log_format)
    _prepare_to_run()
    try:
        server.run()  # until Ctrl+C or SIGTERM
    finally:
        log.close()
        runner.close()
        embedders.close()
        engine.close()
    return 0


def _embedders(args: argparse.Namespace, model_path: Path, names: tuple[str, ...]) -> OneEmbedder:
    """Who answers the embeddings endpoints: ``--embedding-model`` (a file, or a catalog or
    hub name, downloaded if needed) loaded now, and the chat model's own file mean-pooled
    when a request names it (loaded then)."""
    from localchat.backends.llama.embedder import Embedder
    from localchat.cli.ask import pull_model_path
    from localchat.server.embeddings import OneEmbedder

    given = getattr(args, "embedding_model", None)
    embedder = None
    if given:
        path = Path(given).expanduser()
        embedder = Embedder(
            path if path.is_file() else pull_model_path(given), n_threads=args.threads
        )
        print(f"localchat: embeddings by {embedder.name} ({embedder.pooling_name} pooling,"
              f" context {embedder.n_ctx})", file=sys.stderr)  # fmt: skip
    return OneEmbedder(embedder, (given,) if given else (), model_path, names)


def _load_engine(
    session: Session, args: argparse.Namespace, config: ServeConfig, model_path: Path
) -> Engine:
    """The model, loaded to serve: replies are decoded side by side, each drafting by
    prompt lookup where it pays (a draft model is not used there yet)."""
    if args.draft_model or args.speculative == "draft":
        print("localchat: serve drafts by prompt lookup only (a draft model is not used"
              " there yet)", file=sys.stderr)  # fmt: skip
    return session.load_model(
        model_path,
        args.ctx or config.ctx,
        args.template,
        n_threads=args.threads,
        kv_type=args.kv_type,
        speculative="ngram" if args.speculative == "draft" else args.speculative,
        lookup_only=True,
        own_cells=OWN_CELLS,  # the sequences' context holds the KV: none wasted here
        warn=lambda line: print(f"localchat: {line}", file=sys.stderr),
    )


def _http_server(
    runner: ModelRunner,
    endpoint: _Endpoint,
    cors_origins: tuple[str, ...],
    embeddings: EmbeddingModels | None = None,
) -> uvicorn.Server:
    """The API over the runner, served by uvicorn (replies under way get ``STOP_GRACE_S``
    to end when it is stopped)."""
    import uvicorn

    from localchat.server.app import create_app

    app = create_app(
        runner, endpoint.api_key, loopback=endpoint.host in LOOPBACK, cors_origins=cors_origins,
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
