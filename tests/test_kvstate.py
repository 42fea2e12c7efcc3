"""State files: layout, validation, atomic saves that survive kill -9, and the disk budget."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localchat.state.kvstate import (
    MAGIC,
    SavedState,
    StateKey,
    StateRejected,
    StateStore,
    encode_state,
    read_state,
)

KEY = StateKey("f" * 64, 4096, "f16", "0.3.36")


def _state(tokens: int = 100, fill: int = 7, payload_bytes: int = 5000) -> SavedState:
    return SavedState(KEY, list(range(tokens)), bytes([fill]) * payload_bytes)


def test_round_trip_and_layout(tmp_path: Path) -> None:
    states = StateStore(tmp_path)
    path = states.save("conv", _state())
    assert path.read_bytes().startswith(MAGIC)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = read_state(path, KEY)
    assert loaded.tokens == list(range(100))
    assert loaded.payload == bytes([7]) * 5000


def test_a_restore_hands_llama_cpp_the_mapped_file_without_a_copy(tmp_path: Path) -> None:
    """The payload is a read-only view of the file's mapping (a private writable one was
    copied whole when pre-faulted), and llama.cpp gets that memory's own address."""
    import ctypes

    import numpy as np

    from localchat.backends.llama.cache import state_pointer

    payload = bytes(range(256)) * 4096
    loaded = read_state(StateStore(tmp_path).save("conv", SavedState(KEY, [1, 2], payload)), KEY)
    assert isinstance(loaded.payload, memoryview) and loaded.payload.readonly
    pointer = state_pointer(loaded.payload)
    address = np.frombuffer(loaded.payload, dtype=np.uint8).__array_interface__["data"][0]
    assert ctypes.addressof(pointer.contents) == address
    assert ctypes.string_at(pointer, len(payload)) == payload


@pytest.mark.parametrize(
    ("other", "reason"),
    [
        (StateKey("e" * 64, 4096, "f16", "0.3.36"), "another model"),
        (StateKey("f" * 64, 2048, "f16", "0.3.36"), "context 4096, now 2048"),
        (StateKey("f" * 64, 4096, "q8_0", "0.3.36"), "KV type f16, now q8_0"),
        (StateKey("f" * 64, 4096, "f16", "0.4.0"), "llama.cpp 0.3.36, now 0.4.0"),
    ],
)
def test_key_mismatch_is_rejected_with_the_reason(
    tmp_path: Path, other: StateKey, reason: str
) -> None:
    path = StateStore(tmp_path).save("conv", _state())
    with pytest.raises(StateRejected, match=reason):
        read_state(path, other)


def test_corruption_and_truncation_are_detected(tmp_path: Path) -> None:
    path = StateStore(tmp_path).save("conv", _state())
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StateRejected, match="checksum"):
        read_state(path, KEY)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(StateRejected, match="truncated"):
        read_state(path, KEY)
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(StateRejected, match="not a localchat state"):
        read_state(path, KEY)


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    one_file = sum(len(chunk) for chunk in encode_state(_state()))
    states = StateStore(tmp_path, budget_bytes=int(one_file * 2.5))
    old = states.save("old", _state())
    os.utime(old, (time.time() - 300, time.time() - 300))
    used = states.save("used", _state())
    os.utime(used, (time.time() - 200, time.time() - 200))
    states.load("used", KEY)  # a restore marks it recently used
    states.save("new", _state())
    remaining = {p.name.split(".")[0] for p in states.files()}
    assert remaining == {"used", "new"}
    assert states.total_bytes() <= states.budget_bytes


def test_encoded_images_kept_beside_the_states_count_in_their_budget(tmp_path: Path) -> None:
    """``paths.image_embeddings_dir`` is in the states folder: the budget is one for both,
    the least recently used of either going first."""
    from localchat.paths import EMBEDDINGS_FOLDER

    one_file = sum(len(chunk) for chunk in encode_state(_state()))
    states = StateStore(tmp_path, budget_bytes=int(one_file * 2.5))
    embeddings = tmp_path / EMBEDDINGS_FOLDER / "projector"
    embeddings.mkdir(parents=True)
    old_image = embeddings / "a.emb"
    old_image.write_bytes(b"x" * one_file)
    os.utime(old_image, (time.time() - 300, time.time() - 300))
    assert states.total_bytes() == one_file
    states.save("one", _state())
    states.save("two", _state())
    assert not old_image.exists()  # the oldest: gone for the new state
    assert {p.name.split(".")[0] for p in states.files()} == {"one", "two"}
    assert states.total_bytes() <= states.budget_bytes


_WRITER = """
import sys
from pathlib import Path
from localchat.state.kvstate import SavedState, StateKey, StateStore
key = StateKey("f" * 64, 4096, "f16", "0.3.36")
states = StateStore(Path(sys.argv[1]))
i = 0
print("ready", flush=True)
while True:
    i += 1
    states.save("conv", SavedState(key, [i] * 1000, bytes([i % 256]) * 40_000_000))
"""


@pytest.mark.parametrize("delay_s", [0.15, 0.4, 0.9])
def test_kill_9_mid_save_leaves_a_valid_state(tmp_path: Path, delay_s: float) -> None:
    states = StateStore(tmp_path)
    states.save("conv", SavedState(KEY, [0] * 1000, bytes([0]) * 40_000_000))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    loaded = read_state(states.path_for("conv", KEY.model_fingerprint), KEY)
    generation = loaded.tokens[0]
    assert loaded.tokens == [generation] * 1000
    assert loaded.payload == bytes([generation % 256]) * 40_000_000


def test_the_background_saver_survives_any_failure(tmp_path: Path) -> None:
    """A save that raises something other than OSError used to end the saver's thread, and
    the next wait() then hung forever."""
    from localchat.state.kvstate import BackgroundSaver

    states = StateStore(tmp_path / "states")
    real_save = states.save
    calls = []

    def flaky(conversation_id: str, state: SavedState) -> Path:
        calls.append(conversation_id)
        if len(calls) == 1:
            raise ValueError("a bug somewhere below")
        return real_save(conversation_id, state)

    states.save = flaky  # type: ignore[method-assign]
    notices: list[str] = []
    saver = BackgroundSaver(states, notices.append)
    saver.save("first", _state())
    assert saver.wait(timeout=10)
    assert notices and "a bug somewhere below" in notices[0] and "transcript is safe" in notices[0]
    saver.save("second", _state())
    assert saver.wait(timeout=10)  # alive: the next save is written
    assert states.load("second", KEY).tokens == list(range(100))
    saver.close()


def test_wait_gives_up_after_its_timeout(tmp_path: Path) -> None:
    import threading

    from localchat.state.kvstate import BackgroundSaver

    states = StateStore(tmp_path / "states")
    release = threading.Event()
    states.save = lambda conversation_id, state: release.wait(5)  # type: ignore[method-assign,assignment,return-value]
    saver = BackgroundSaver(states)
    saver.save("slow", _state())
    saver.save("next", _state())
    assert saver.pending == 2  # the first is being written, the second waits
    started = time.perf_counter()
    assert saver.wait(timeout=0.2) is False
    assert time.perf_counter() - started < 2
    release.set()
    assert saver.wait(timeout=10)
    assert saver.pending == 0
    saver.close()
