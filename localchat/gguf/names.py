"""The name a model is shown and served under: the one users know it by, its repository's
or its file's (``SmolLM2-135M-Instruct Q4_1``), never ``general.name`` (often a training
run's label, "Smollm2 135M 8k Lc100K Mix1 Ep2").

Read off the path alone: a file in the Hugging Face cache (``models--Org--Repo/snapshots/
<commit>/file.gguf``) or in LM Studio's folders (``.lmstudio/models/publisher/repo/
file.gguf``) has its repository there; any other file has its own name.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from localchat.gguf.quants import find_tag

SPLIT_SUFFIX_RE = re.compile(r"-\d{5}-of-\d{5}$")
# A file named by its contents' hash (an Ollama blob) says nothing of the model.
BLOB_RE = re.compile(r"^sha256[-:][0-9a-f]{64}$")
LM_STUDIO_HOMES = (".lmstudio", "lm-studio")
REPO_SUFFIX_RE = re.compile(r"[-_.]gguf$", re.IGNORECASE)
SEPARATORS = "-_. "


def display_name(path: Path | str, fallback: str | None = None) -> str:
    """``path``'s model as users know it: its name (the repository's spelling where the
    file is named after its repository) and its quant tag, ``SmolLM2-135M-Instruct Q4_1``.
    A name whose tag is not at its end (``demo-tiny-Q4_K_M-s0``) stays as it is; a file
    named by a hash gives ``fallback`` (the file's own ``general.name``) where there is one."""
    path = Path(path)
    stem = SPLIT_SUFFIX_RE.sub("", path.name.removesuffix(".gguf"))
    if BLOB_RE.match(stem):
        return fallback or stem
    base, tag = _split_tag(stem)
    repo = repo_of(path)
    if repo is not None:
        repo_base = REPO_SUFFIX_RE.sub("", repo.rsplit("/", 1)[-1])
        if _squashed(repo_base) == _squashed(base):
            base = repo_base
    return f"{base} {tag}" if tag else base


def repo_of(path: Path) -> str | None:
    """The repository a model file came from, where its path says (the Hugging Face cache,
    LM Studio's ``publisher/repo/file.gguf``); None for any other file."""
    parents = path.parents
    for below, parent in itertools.pairwise(parents):
        if parent.name.startswith("models--") and below.name == "snapshots":
            return parent.name.removeprefix("models--").replace("--", "/", 1)
    if len(parents) > 3 and parents[2].name == "models" and parents[3].name in LM_STUDIO_HOMES:
        return f"{parents[1].name}/{parents[0].name}"
    return None


def _split_tag(stem: str) -> tuple[str, str | None]:
    """The stem without the quant tag that ends it, and that tag; a tag elsewhere (or none)
    leaves the stem whole."""
    found = find_tag(stem)
    if found is None:
        return stem, None
    tag, start, end = found
    base = stem[:start].rstrip(SEPARATORS)
    if stem[end:].strip(SEPARATORS) or not base:
        return stem, None
    return base, tag.tag


def _squashed(name: str) -> str:
    """A name compared without case or separators (``smollm2-135m`` is ``SmolLM2_135M``)."""
    return "".join(c for c in name.lower() if c.isalnum())
