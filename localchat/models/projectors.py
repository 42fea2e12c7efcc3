"""Which vision projector goes with a model: the one given, else one found beside it.

Vision models ship as two files, the language model and its projector (``mmproj-*.gguf``),
and every tool that downloads them (``pull --mmproj``, LM Studio, huggingface-hub's
snapshots) puts them in one folder. A projector fits a model when it projects into the
model's embedding width (``clip.vision.projection_dim``); among those, the model's own
quant tag is preferred, then the 16- and 32-bit ones vision models publish.
"""

from __future__ import annotations

from pathlib import Path

from localchat.errors import ModelFileError, UsageError
from localchat.gguf.estimate import VisionTower
from localchat.gguf.info import is_projector, read_gguf
from localchat.gguf.quants import tag_of_file

PREFERRED_TAGS = ("F16", "BF16", "F32", "Q8_0")


def projection_dim(path: Path) -> int:
    """The embedding width a projector file projects images into (0: not a projector)."""
    metadata = read_gguf(path).metadata
    return int(metadata.get("clip.vision.projection_dim", 0) or 0)


def projector_memory_bytes(path: Path) -> int:
    """What a projector takes loaded: its weights (the file, less a header) and the compute
    buffer of one image's encode, from its vision tower's numbers (``VisionTower``). An
    estimate for planning: libmtmd reserves the buffer only at its first encode."""
    tower = VisionTower.of_metadata(read_gguf(path).metadata)
    return path.stat().st_size + tower.encode_buffer_bytes()


def find_projector(model: Path) -> Path | None:
    """The projector beside ``model`` that fits it (None: none there)."""
    try:
        width = read_gguf(model).n_embd
    except (ModelFileError, OSError):
        return None
    fitting = []
    for candidate in sorted(model.parent.glob("*.gguf")):
        if candidate != model and is_projector(candidate.name):
            try:
                if projection_dim(candidate) == width:
                    fitting.append(candidate)
            except (ModelFileError, OSError):
                continue
    if not fitting:
        return None
    own = tag_of_file(model.name)
    wanted = [own.tag if own else "", *PREFERRED_TAGS]

    def rank(path: Path) -> tuple[int, int]:
        tag = tag_of_file(path.name)
        name = tag.tag if tag else ""
        return (wanted.index(name) if name in wanted else len(wanted), path.stat().st_size)

    return min(fitting, key=rank)


def chosen_projector(model: Path, given: str | None) -> Path | None:
    """The projector a launch uses: ``given`` (a file, checked to fit), else the one beside
    the model. ``given`` as ``"none"`` turns images off."""
    if given is None:
        return find_projector(model)
    if given == "none":
        return None
    path = Path(given).expanduser()
    if not path.is_file():
        raise UsageError(f"--mmproj {given}: no such file; give the projector's .gguf file")
    try:
        width = projection_dim(path)
        model_width = read_gguf(model).n_embd
    except ModelFileError as exc:
        raise UsageError(f"--mmproj {given}: {exc}") from None
    if not width:
        raise UsageError(f"--mmproj {given} is not a vision projector (no clip.vision keys)")
    if width != model_width:
        raise UsageError(
            f"--mmproj {given} projects into {width} dimensions and {model.name} reads"
            f" {model_width}: it is another model's projector"
        )
    return path
