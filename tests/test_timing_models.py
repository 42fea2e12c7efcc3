"""Models that are only timed or measured: a shape at a quant's type mix in random blocks must
hold exactly what llama.cpp's quantizer writes for that shape and quant, and run."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from localchat.backends.base import Sampling
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.errors import UsageError
from localchat.gguf.info import read_gguf
from localchat.models.demo import SHAPES, make_demo_model
from localchat.models.timing_models import K_BLOCK, ensure_mix_model, narrow_twin


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    return {
        t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.n_bytes))
        for t in GGUFReader(path).tensors
    }


@pytest.mark.parametrize(
    ("shape", "quant"),
    [
        ("tiny", "Q4_K_M"),
        ("small", "Q2_K"),
        ("small", "Q6_K"),
        ("small", "Q5_K_M"),
        ("tiny", "IQ4_XS"),
        ("swa-tiny", "Q4_K_M"),
    ],
)
def test_a_mix_model_holds_what_the_quantizer_writes(
    shape: str, quant: str, tmp_path: Path
) -> None:
    # Rows that do not divide into k-quant blocks (tiny: 128) fall back to other types, the
    # value and down projections of some layers get more bits, Gemma 3's attention width is
    # its own row length: every tensor's type, shape and bytes must be the quantizer's.
    real = make_demo_model(tmp_path / "real.gguf", shape, quant)
    mix = ensure_mix_model(tmp_path / "mix", shape, quant)
    assert _tensors(mix) == _tensors(real)
    assert read_gguf(mix).file_type == read_gguf(real).file_type


def test_a_twin_keeps_every_row_length_in_its_block_class() -> None:
    for shape in SHAPES.values():
        twin = narrow_twin(shape)
        assert (twin.n_layer, twin.n_head, twin.n_head_kv) == (
            shape.n_layer, shape.n_head, shape.n_head_kv
        )  # fmt: skip
        for length, twin_length in (
            (shape.n_embd, twin.n_embd),
            (shape.n_ff, twin.n_ff),
            (shape.n_head * shape.head_dim, twin.n_head * twin.head_dim),
        ):
            assert twin_length <= length
            assert (twin_length % K_BLOCK == 0) == (length % K_BLOCK == 0)


def test_a_mix_model_runs_and_is_made_once(tmp_path: Path) -> None:
    path = ensure_mix_model(tmp_path, "tiny", "Q4_K_M")
    made = path.stat().st_mtime_ns
    assert ensure_mix_model(tmp_path, "tiny", "Q4_K_M").stat().st_mtime_ns == made
    engine = Engine(path, LoadOptions(n_ctx=256))
    try:
        generation = engine.generate([engine.bos_token, 300, 301], Sampling(temperature=0.0), 8)
        for _ in generation:
            pass
        assert generation.stats.generated_tokens > 0
    finally:
        engine.close()
    with pytest.raises(UsageError, match="unknown shape"):
        ensure_mix_model(tmp_path, "huge", "Q4_K_M")
