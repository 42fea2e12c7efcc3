"""Readers of outside bytes, fuzzed: GGUF headers and KV state files.

Seeded random, truncated and bit-flipped inputs (thousands, in seconds) may only ever give
the project's own one-line errors: never another exception, never a hang.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from localchat.errors import LocalchatError
from localchat.gguf.estimate import LayerWeights, ModelDims
from localchat.gguf.info import read_gguf
from localchat.state.kvstate import SavedState, StateKey, StateRejected, StateStore

CASES = 1500
BUDGET_S = 25.0


def _mutations(data: bytes, rng: random.Random, header_end: int) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:  # truncated anywhere
        return data[: rng.randrange(len(data))]
    if kind == 1:  # a few bits flipped in the header
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(min(len(out), header_end))
            out[at] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 2:  # a run of random bytes over the header
        out = bytearray(data)
        at = rng.randrange(min(len(out), header_end))
        run = rng.randint(1, 64)
        out[at : at + run] = rng.randbytes(run)
        return bytes(out)
    return rng.randbytes(rng.randint(0, 4096))  # no GGUF at all


def _use(info: object) -> None:
    """What listings and plans read from a header."""
    from localchat.gguf.info import GGUFInfo

    assert isinstance(info, GGUFInfo)
    dims = ModelDims.from_gguf(info)
    LayerWeights.from_gguf(info)
    _ = (info.file_type, info.chat_template, info.name, dims.window_layers())


def test_the_gguf_header_reader_only_raises_its_own_errors(
    tiny_model: Path, tmp_path: Path
) -> None:
    data = tiny_model.read_bytes()
    header_end = read_gguf(tiny_model).data_offset
    rng = random.Random(20261201)
    target = tmp_path / "fuzzed.gguf"
    outcomes = {"rejected": 0, "read": 0}
    start = time.monotonic()
    for case in range(CASES):
        target.write_bytes(_mutations(data, rng, header_end))
        try:
            _use(read_gguf(target))
            outcomes["read"] += 1
        except LocalchatError as exc:
            assert "\n" not in str(exc), f"case {case}: {exc!r}"
            outcomes["rejected"] += 1
        except Exception as exc:  # the defect this test is for
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert time.monotonic() - start < BUDGET_S, f"slow at case {case}"
    assert outcomes["rejected"] > CASES // 3 and outcomes["read"] > 0


def test_the_state_reader_only_rejects_with_a_reason(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "states")
    key = StateKey("fp", 512, "f16", "0.3")
    payload = bytes(range(256)) * 40
    store.save("conv", SavedState(key, list(range(300)), payload))
    path = next((tmp_path / "states").glob("*.lckv"))
    data = path.read_bytes()
    assert store.load("conv", key).tokens == list(range(300))
    rng = random.Random(7)
    start = time.monotonic()
    rejected = 0
    for case in range(CASES):
        mutated = _mutations(data, rng, 400)
        if mutated == data:
            continue
        path.write_bytes(mutated)
        try:
            store.load("conv", key)
        except StateRejected as exc:
            assert "\n" not in str(exc)
            rejected += 1
        except Exception as exc:
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert time.monotonic() - start < BUDGET_S, f"slow at case {case}"
    assert rejected > CASES * 0.9  # a flipped bit anywhere is caught (checksum)
