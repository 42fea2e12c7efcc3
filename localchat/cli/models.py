"""The model commands: this machine and what runs on it, the catalog, downloads, local files."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from localchat.cli.interrupt import EXIT_INTERRUPTED
from localchat.cli.progress import download_progress, step_progress
from localchat.errors import UsageError
from localchat.paths import app_paths

if TYPE_CHECKING:
    from localchat.models.hub import RemoteFile
    from localchat.models.library import Library, ModelRequest


def default_model() -> Path:
    """The starter model (SmolLM2-135M-Instruct, fetched once), else a generated one."""
    from localchat.models.starter import ensure_starter

    with download_progress() as draw:
        choice = ensure_starter(app_paths(), draw)
    print(f"localchat: {choice.note or f'no model given: {choice.path.name}'}", file=sys.stderr)
    return choice.path


def library() -> Library:
    """The user's models, planned for this machine."""
    from localchat.models.hardware import detect_hardware
    from localchat.models.library import Library
    from localchat.settings import load_settings

    min_tps = load_settings(app_paths().settings_file).min_tokens_per_s
    return Library(app_paths(), detect_hardware(), min_tps=min_tps)


def pull(
    models: Library,
    request: ModelRequest,
    json_lines: bool,
    out: TextIO | None = None,
    projector: bool | None = None,
) -> list[Path]:
    """Download the model asked for with progress on stderr: a redrawn line on a terminal, plain lines
    otherwise, or JSON lines on ``out``. Ctrl-C stops it (the next pull resumes). A vision
    model's projector comes along (``projector`` None: where the repo has one; True: it
    must; False: never)."""
    cancel = threading.Event()
    with download_progress(json_lines, out) as draw:
        try:
            wanted = _projector_to_pull(models, request, projector)  # refused first
            paths = [models.pull(request, draw, cancel)]
            if wanted is not None:
                paths.append(models.pull_projector(wanted, draw, cancel))
            return paths
        except KeyboardInterrupt:
            cancel.set()
            raise


def _projector_to_pull(
    models: Library, request: ModelRequest, asked: bool | None
) -> RemoteFile | None:
    """The projector a pull brings: the repo's, where it has one (and ``asked`` is not
    False); a repo without one is an error only where ``asked``."""
    if asked is False:
        return None
    try:
        return models.projector_for(request)
    except UsageError:
        if asked:
            raise
        return None


def cmd_hw(args: argparse.Namespace, out: TextIO) -> int:
    from dataclasses import replace

    from localchat.models.catalog import load_catalog
    from localchat.models.draft_plan import with_catalog_drafts
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
        from localchat.models.projectors import find_projector, projector_memory_bytes

        projector = find_projector(args.model_path)
        extra = projector_memory_bytes(projector) if projector else 0
        plans = [plan_file(args.model_path, hardware, args.ctx, speed, min_tps, extra)]
    else:
        catalog = load_catalog(app_paths().user_catalog)
        plans = plan_catalog(catalog, hardware, args.ctx, speed, min_tps)
        plans = with_catalog_drafts(catalog, plans, hardware, speed)
    if args.json:
        payload = {"hardware": hardware_json(hardware), "plans": [plan.as_json() for plan in plans]}
        out.write(json.dumps(payload, indent=2) + "\n")
        return 0
    out.write(format_hardware_report(hardware, plans, speed))
    return 0


def cmd_pull(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.models.hub import DownloadCancelled

    try:
        models = library()
        paths = pull(models, models.request(args.model), args.json, out, args.mmproj)
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

    models = library()
    for folder in args.scan:
        models.add_scan_dir(folder)
    rows = models.rows(args.ctx)
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
        if r.vision:
            mark = f"{mark} (vision)".lstrip()
        out.write(
            f"{r.model[:28]:28} {quant:10} {format_bytes(r.size_bytes):>10} {needs:>10}"
            f" {speed:>9} {r.fit:8} {mark}\n"
        )
    if any(r.planned for r in rows):
        out.write("* the planner's pick for this machine (speed: predicted tokens/s here)\n")
    if any(r.vision for r in rows):
        out.write("(vision) reads images: `localchat pull` brings its projector too\n")
    return 0


def cmd_rm(args: argparse.Namespace, out: TextIO) -> int:
    removed = library().remove(args.model, args.mmproj)
    out.write(f"removed {args.model} ({len(removed)} files)\n")
    return 0


def cmd_add(args: argparse.Namespace, out: TextIO) -> int:
    out.write(library().add_local(args.path, args.name) + "\n")
    return 0


def cmd_demo_model(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.models.demo import make_demo_model

    path = make_demo_model(args.out, args.shape, args.quant, args.seed, tokenizer=args.tokenizer)
    out.write(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.shape}, {args.quant}, seed {args.seed})\n"
    )
    return 0
