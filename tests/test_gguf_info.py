"""GGUF header inspection: the numbers llama.cpp uses, and clean errors for broken files."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from localchat.errors import ModelFileError
from localchat.gguf.info import read_gguf
from localchat.models.demo import SHAPES


def test_reads_architecture_numbers_and_tensor_sizes(tiny_model: Path) -> None:
    info = read_gguf(tiny_model)
    shape = SHAPES["tiny"]
    assert info.architecture == "llama"
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv) == (
        shape.n_layer,
        shape.n_embd,
        shape.n_head,
        shape.n_head_kv,
    )
    assert info.head_dim_k == info.head_dim_v == shape.head_dim
    assert info.context_length == shape.context_length
    assert info.sliding_window == 0
    assert info.file_type == "Q4_K_M"
    # Tensor bytes account for the whole file past the header (up to alignment padding).
    size = tiny_model.stat().st_size
    assert info.end_of_data == size
    assert 0 <= size - info.weights_bytes - info.data_offset < 64 * len(info.tensors)
    layers = {t.layer for t in info.tensors}
    assert layers == {None, *range(shape.n_layer)}


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am a text file")
    with pytest.raises(ModelFileError, match="not a GGUF file") as err:
        read_gguf(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [3, 24, 2000, 200_000])
def test_truncated_file(tiny_model: Path, tmp_path: Path, keep: int) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_model.read_bytes()[:keep])
    with pytest.raises(ModelFileError, match=r"truncated|not a GGUF"):
        read_gguf(path)


def test_header_lying_about_sizes_is_an_error_not_an_allocation(tmp_path: Path) -> None:
    # GGUF v3, 1 tensor, 1 key whose name claims to be 2**60 bytes long.
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 2**60) + b"x" * 16
    path = tmp_path / "liar.gguf"
    path.write_bytes(header)
    with pytest.raises(ModelFileError, match="corrupt GGUF header"):
        read_gguf(path)
    huge_counts = b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40)
    path.write_bytes(huge_counts)
    with pytest.raises(ModelFileError, match="corrupt GGUF header"):
        read_gguf(path)
