"""``bench --only ui``: the app's startup time and streaming overhead (measured by
``bench/app/measure.py``, imported only when this part runs: the rest of the bench package
never loads Textual)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localchat.bench.common import Progress, say


def bench_ui(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """The app's startup time and streaming overhead, on the tiny demo model."""
    from localchat.bench.app.measure import bench_ui as measure_ui  # the app's own measurements
    from localchat.models.demo import ensure_demo_model
    from localchat.paths import app_paths

    tiny = ensure_demo_model(app_paths().demo_models_dir, "tiny", "Q4_K_M")
    say(progress, "ui: startup and streaming overhead on the tiny model")
    return measure_ui(tiny, model_path)
