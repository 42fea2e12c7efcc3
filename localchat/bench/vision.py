"""``bench --only vision``: a conversation that holds an image, on the bench's language model
with a generated projector beside it (``vit-bench``: 576 image tokens, LLaVA-1.5's weight in
the context) and a random 640x480 PNG. About a minute on two quiet cores (the first turn
reads ~600 tokens; every other turn ~25); several where other programs hold the cores.

- ``image_resume_vs_warm``: the turn after the image and a follow-up, resumed in a new
  process (``ask --conversation``, the saved state restored) against the same turn warm
  here; the median ratio of pairs taken side by side, as ``resume`` takes them (the
  restore and the prompt read). ``image_resume_vs_warm_sent``, reported: the same pairs
  from the message sent, the prompt built in the wait (the new process reads the picture
  from the store and has libmtmd cut its tokens again).
- ``image_encodes_on_resume``: images the new processes encoded (``images_encoded`` in
  ``ask --json``'s stats, the most of any round): the image is in the state restored, and
  its embeddings are kept on disk for a replay, so none.
- ``image_turn_reread``: of the follow-up's prompt (the image in it), the share evaluated.
- Reported: ``image_encode_s`` (the projector's encode alone, median of rounds),
  ``image_tokens``, the first-token waits (``image_first_turn_ttft_s``: the image encoded,
  decoded and the text read, from an empty cache) and whether the replies agree.
"""

from __future__ import annotations

import io
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.bench.common import (
    REPLY_TOKENS,
    ChildHome,
    Progress,
    ask_in_new_process,
    say,
    scratch_dir,
)

if TYPE_CHECKING:
    from localchat.backends.llama.engine import Engine
    from localchat.conversation.local import Conversation
    from localchat.conversation.turn import ConversationTurn
    from localchat.paths import AppPaths

LOOK = "What is in this picture?"
FOLLOW = "And what colour is it, mostly?"
NEXT = "Tell me more about the picture."
VISION_CTX = 2048
VISION_ROUNDS = 5  # pairs of the next turn, warm and resumed (``resume``'s count)
ENCODE_ROUNDS = 5
PICTURE_SIZE = (640, 480)


@dataclass(frozen=True)
class VisionSetup:
    """What the part measures on: the language model, the projector's shape and the rounds
    (the test runs the plumbing on the tiny model and ``vit-tiny``, one round)."""

    model: Path
    projector_shape: str = "vit-bench"
    rounds: int = VISION_ROUNDS
    encode_rounds: int = ENCODE_ROUNDS
    picture_size: tuple[int, int] = PICTURE_SIZE
    n_ctx: int = VISION_CTX


def bench_vision(model_path: Path, progress: Progress = None) -> dict[str, Any]:
    """A conversation with an image: resumed in a new process against warm, the follow-up's
    share re-read, the image's encode timed, on the bench's model with a generated projector
    (another demo shape's model where ``model_path``'s width is none of theirs)."""
    return measure_vision(VisionSetup(_model_with_a_shape(model_path)), progress)


def _model_with_a_shape(model_path: Path) -> Path:
    """``model_path`` where a generated projector can be made for its width, else the
    bench's default demo model."""
    if _lm_shape(model_path) is not None:
        return model_path
    from localchat.models.demo import ensure_demo_model
    from localchat.paths import app_paths

    return ensure_demo_model(app_paths().demo_models_dir, "0.5b", "Q4_K_M")


def _lm_shape(model_path: Path) -> str | None:
    """The demo shape of ``model_path``'s embedding width (what the projector projects to)."""
    from localchat.gguf.info import read_gguf
    from localchat.models.demo_shapes import SHAPES

    width = read_gguf(model_path).n_embd
    return next((name for name, shape in SHAPES.items() if shape.n_embd == width), None)


def random_png(size: tuple[int, int], seed: int = 0) -> bytes:
    """A PNG of random pixels (it compresses to nothing less than its pixels)."""
    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def measure_vision(setup: VisionSetup, progress: Progress = None) -> dict[str, Any]:
    """The part's figures for ``setup``: in a scratch home, the model and the projector made
    for it side by side in one folder (as ``pull`` leaves a vision model), the picture in
    the home's image store."""
    from localchat.chat.image_files import inspect_image
    from localchat.models.demo_vision import make_projector
    from localchat.paths import AppPaths
    from localchat.state.images import ImageStore

    shape = _lm_shape(setup.model)
    if shape is None:
        raise ValueError(f"no generated projector fits {setup.model.name}'s width")
    with scratch_dir("vision") as home:
        folder = home / "models"
        folder.mkdir()
        model = folder / setup.model.name
        model.symlink_to(setup.model.resolve())
        make_projector(
            folder / f"mmproj-{setup.projector_shape}-F16.gguf", shape, setup.projector_shape
        )
        paths = AppPaths(home / "data", home / "config", home / "cache")
        picture = inspect_image(random_png(setup.picture_size), "bench.png")
        key = ImageStore(paths.images_dir).put(picture).key
        return _measure(setup, model, paths, key, progress)


@dataclass
class _Figures:
    """What the part found: the first two turns' stats, the encode, and the paired rounds
    (each warm turn's first-token wait, the warm reply, each new process's payload)."""

    first: dict[str, Any] = field(default_factory=dict)
    follow: dict[str, Any] = field(default_factory=dict)
    encode_s: float = 0.0
    image_tokens: int = 0
    warm: list[float] = field(default_factory=list)
    warm_sent: list[float] = field(default_factory=list)  # from ``send``: the prompt built too
    warm_reply: str = ""
    resumed: list[dict[str, Any]] = field(default_factory=list)


def _measure(
    setup: VisionSetup, model: Path, paths: AppPaths, key: str, progress: Progress
) -> dict[str, Any]:
    """The image and a follow-up warm here, the encode timed, then the paired rounds."""
    from localchat.conversation.local import Conversation
    from localchat.models.launch import LaunchOptions
    from localchat.models.loader import ModelLoader
    from localchat.state.kvstate import StateStore
    from localchat.state.store import Store

    figures = _Figures()
    engine = ModelLoader(paths).load(model, LaunchOptions(n_ctx=setup.n_ctx), on_this_thread=True)
    store = Store(paths.database)
    try:
        conversation = Conversation.open(store, StateStore(paths.states_dir), "bench", engine)
        figures.first = _turn(conversation, LOOK, (key,)).stats_dict()
        figures.follow = _turn(conversation, FOLLOW).stats_dict()
        conversation.wait_saved()
        say(progress, f"vision: first turn {figures.first['ttft_s']:.3f} s (the image encoded)")
        figures.encode_s, figures.image_tokens = _encode_time(engine, key, setup.encode_rounds)
        say(progress, f"vision: encode {figures.encode_s:.4f} s, {figures.image_tokens} tokens")
        backup = paths.data_dir.parent / "backup"
        shutil.copytree(paths.data_dir, backup)
        child = ChildHome(backup, paths.data_dir.parent / "child")
        _paired_rounds(figures, conversation, engine, child, model, setup)
        conversation.close()
    finally:
        store.close()
        engine.close()
    resumed = statistics.median(float(run["stats"]["ttft_s"]) for run in figures.resumed)
    say(progress, f"vision: warm {statistics.median(figures.warm):.3f} s,"
        f" new process {resumed:.3f} s (medians)")  # fmt: skip
    return _report(figures)


def _paired_rounds(
    figures: _Figures,
    conversation: Conversation,
    engine: Engine,
    child: ChildHome,
    model: Path,
    setup: VisionSetup,
) -> None:
    """``setup.rounds`` pairs of the next turn, warm here and resumed in a new process on a
    copy of the data, the order alternating so that the host's drift cancels."""
    history = list(engine.cache.cached_tokens)
    for index in range(setup.rounds):
        for side in ("warm", "resumed") if index % 2 == 0 else ("resumed", "warm"):
            if side == "warm":  # the same turn again, the cache cut back to the history
                turn = _turn(conversation, NEXT)
                figures.warm.append(turn.resume_ttft_s)
                figures.warm_sent.append(turn.sent_ttft_s)
                figures.warm_reply = turn.generation.text
                conversation.take_back_last_exchange()
                engine.cache.hold(history)
                conversation.wait_saved()  # not written while a new process is timed
            else:
                child.reset()
                figures.resumed.append(ask_in_new_process(child.path, model, NEXT, setup.n_ctx))


def _turn(conversation: Conversation, text: str, images: tuple[str, ...] = ()) -> ConversationTurn:
    """One greedy turn, run to its end."""
    from localchat.backends.base import Sampling

    turn = conversation.send(text, Sampling(temperature=0.0), REPLY_TOKENS, images=images)
    for _ in turn:
        pass
    return turn


def _encode_time(engine: Engine, key: str, rounds: int) -> tuple[float, int]:
    """The projector's encode of the stored image alone (its preprocessing and every slice's
    encode, nothing decoded into the context), the median of ``rounds``; and the image's
    tokens."""
    from localchat.backends.llama.vision import Image

    reader = engine.image_reader
    if reader is None:
        raise RuntimeError(f"{engine.model_name} loaded without its projector")
    projector = reader.projector
    image = projector.pixels(Image(reader.source.get(key)))  # the file decoded once, as ever
    times: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        projector.encode(image)
        times.append(time.perf_counter() - start)
    return statistics.median(times), projector.image_tokens(image)


def _report(figures: _Figures) -> dict[str, Any]:
    """The part's figures (``image_replies_identical``: not ``replies_identical``, which is
    ``resume``'s and would be overwritten in a full run's flat report)."""
    resumed = [run["stats"] for run in figures.resumed]
    ratios = [float(r["ttft_s"]) / w for r, w in zip(resumed, figures.warm, strict=True)]
    sent = [float(r["sent_ttft_s"]) / w for r, w in zip(resumed, figures.warm_sent, strict=True)]
    follow = figures.follow
    return {
        "image_tokens": figures.image_tokens,
        "image_encode_s": round(figures.encode_s, 4),
        "image_first_turn_ttft_s": round(float(figures.first["ttft_s"]), 4),
        "image_first_turn_encoded": figures.first["images_encoded"],
        "image_warm_ttft_s": round(statistics.median(figures.warm), 4),
        "image_resume_ttft_s": round(statistics.median(float(r["ttft_s"]) for r in resumed), 4),
        "image_resume_vs_warm": round(statistics.median(ratios), 3),
        "image_resume_vs_warm_sent": round(statistics.median(sent), 3),
        "image_encodes_on_resume": max(int(r["images_encoded"]) for r in resumed),
        "image_resume_restored": all(r["restored_from_state"] for r in resumed),
        "image_resume_prompt_tokens_evaluated": max(
            int(r["prompt_tokens_evaluated"]) for r in resumed
        ),
        "image_follow_prompt_tokens": follow["prompt_tokens"],
        "image_turn_reread": round(follow["prompt_tokens_evaluated"] / follow["prompt_tokens"], 4),
        "image_replies_identical": all(
            run["reply"] == figures.warm_reply for run in figures.resumed
        ),
    }
