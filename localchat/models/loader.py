"""One way to load a model, for the app, ``ask`` and ``serve``'s router alike: the launch
options (``launch.LaunchOptions``) made into an engine, with the template the catalog
names, the draft model and what the calibration says of it, the step costs measured here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.engine import DEFAULT_CTX as ENGINE_DEFAULT_CTX
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.errors import UsageError
from localchat.gguf.info import file_fingerprint
from localchat.models.catalog import catalog_draft, catalog_template
from localchat.models.draft_plan import DraftPlan
from localchat.models.hardware import detect_hardware
from localchat.models.launch import LaunchOptions
from localchat.models.library import Library
from localchat.models.projectors import chosen_projector
from localchat.models.speed import calibrated_step_costs
from localchat.paths import AppPaths
from localchat.state.images import ImageStore

Say = Callable[[str], object]


class ModelLoader:
    """Loads models for one user's paths (the catalog, the calibration, the library)."""

    def __init__(self, paths: AppPaths) -> None:
        self.paths = paths

    def load(
        self,
        path: Path,
        launch: LaunchOptions,
        warn: Say | None = None,
        on_this_thread: bool = False,
    ) -> Engine:
        """Load ``path`` as ``launch`` asks, on the compute thread (``on_this_thread``: here,
        where the model will evaluate, so llama.cpp keeps one thread pool: the CLI's main
        thread). ``warn``: a draft model asked for that does not draft, and why (the flag's
        that cannot be had is an error)."""
        say = warn or (lambda _line: None)
        speculative = launch.speculative or "auto"
        kv_type = launch.kv_type or "f16"
        draft = None if launch.lookup_only else self._draft_plan(path, launch, say)
        projector = chosen_projector(path, launch.projector)
        options = LoadOptions(
            n_ctx=launch.n_ctx,
            n_threads=launch.n_threads,
            kv_type=kv_type,
            template=launch.template or catalog_template(path, self.paths.user_catalog),
            swa_cache=launch.swa_cache or "window",
            speculative=speculative,
            draft_model=draft.path if draft else None,
            draft_required=launch.draft_required,
            step_costs=calibrated_step_costs(self.paths.speed_calibration, path),
            draft_step_cost=draft.step_cost if draft else None,
            own_cells=launch.own_cells,
            flash_attn=launch.flash_attn,
            n_ubatch=launch.n_ubatch or LoadOptions.n_ubatch,
            projector=projector,
            images=ImageStore(self.paths.images_dir) if projector else None,
            embeddings_dir=self._embeddings_dir(projector),
        )
        engine = Engine(path, options) if on_this_thread else run_compute(Engine, path, options)
        unused = engine.draft_model_unused
        if unused and (launch.draft_model or speculative == "draft"):
            say(unused)
        return engine

    def _embeddings_dir(self, projector: Path | None) -> Path | None:
        """Where a projector's encoded images are kept: a folder per projector file."""
        if projector is None:
            return None
        return self.paths.image_embeddings_dir / file_fingerprint(projector)[:32]

    def _draft_plan(self, target: Path, launch: LaunchOptions, say: Say) -> DraftPlan | None:
        """The draft model and what the calibration says of it: the one the launch names;
        else, drafting with one, the catalog's for this model where it is downloaded and
        fits (and, under ``auto``, is predicted to pay)."""
        mode = launch.speculative or "auto"
        asked = launch.draft_model
        if mode in ("off", "ngram"):
            if asked and launch.draft_required:
                say(f"the draft model {asked} is not used: speculative is {mode!r}")
            return None
        ctx = launch.n_ctx or ENGINE_DEFAULT_CTX
        kv_type = launch.kv_type or "f16"
        if asked:
            try:  # the library (and the catalog it reads) only where a draft is asked for
                library = Library(self.paths, detect_hardware())
                found = library.draft_path(asked)
            except UsageError as exc:
                if launch.draft_required:
                    raise
                say(f"{exc} (the draft_model setting)")  # the model still loads
                return None
            return library.plan_for_draft(target, found, ctx, kv_type)
        entry = catalog_draft(target, self.paths.user_catalog)  # a broken catalog: none
        if entry is None:
            return None
        library = Library(self.paths, detect_hardware())
        plan = library.draft_plan(target, entry, ctx, kv_type)
        if plan is None or not plan.fits or (mode == "auto" and not plan.pays):
            return None
        return plan
