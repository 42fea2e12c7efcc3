"""A catalog vision model's projector, known before anything is downloaded.

The catalog names each vision model's ``mmproj`` files with their sizes, so a pull fetches
the projector the hub's own rule picks (``hub.choose_projector``: the model's tag, else the
16/32-bit one) without listing the repo, and a plan counts its bytes and its encode's
buffer (the catalog gives the tower's numbers) offline, as ``projector_memory_bytes``
counts them for a downloaded one.
"""

from __future__ import annotations

from localchat.models.catalog import CatalogModel
from localchat.models.hub import RemoteFile, choose_projector


def catalog_projector(model: CatalogModel, quant: str) -> RemoteFile | None:
    """The projector a pull of ``model`` at ``quant`` brings (None: a text model)."""
    if not model.projectors:
        return None
    files = [RemoteFile(model.repo, p.file, p.size, p.quant) for p in model.projectors]
    return choose_projector(model.repo, files, quant)


def planned_projector_bytes(model: CatalogModel) -> int:
    """The projector bytes to plan a catalog model with before its quant is chosen: the
    largest file any of its quants would bring, so a plan never leaves too little room,
    and one image's encode buffer from its tower's numbers (0: a text model)."""
    chosen = (catalog_projector(model, f.quant) for f in model.files)
    largest = max((p.size for p in chosen if p is not None), default=0)
    if not largest or model.tower is None:
        return largest
    return largest + model.tower.encode_buffer_bytes()
