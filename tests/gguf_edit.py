"""GGUF copies with changed metadata, made with gguf's own metadata copier (tensors as is)."""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata


def rewrite_metadata(
    source: Path,
    dest: Path,
    set_uint32: dict[str, int] | None = None,
    remove: tuple[str, ...] = (),
) -> Path:
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    writer = gguf.GGUFWriter(dest, arch=arch.contents(), endianess=reader.endianess)
    changes = {
        key: MetadataDetails(gguf.GGUFValueType.UINT32, value)
        for key, value in (set_uint32 or {}).items()
    }
    copy_with_new_metadata(reader, writer, changes, list(remove))
    return dest
