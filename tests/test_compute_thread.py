"""llama.cpp work runs on one long-lived thread, whoever asks for it."""

from __future__ import annotations

import threading
import time

import pytest

from localchat.backends.compute_thread import on_compute_thread, run_compute


def _where() -> tuple[int, bool]:
    return threading.get_ident(), on_compute_thread()


def test_calls_from_different_threads_all_run_on_the_same_thread() -> None:
    seen: list[tuple[int, bool]] = []
    callers = [threading.Thread(target=lambda: seen.append(run_compute(_where))) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    seen.append(run_compute(_where))
    assert len({ident for ident, _ in seen}) == 1
    assert all(flag for _, flag in seen)
    assert seen[0][0] != threading.get_ident()
    assert not on_compute_thread()


def test_the_functions_error_is_raised_to_the_caller() -> None:
    def fail() -> None:
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        run_compute(fail)


def test_a_call_from_the_compute_thread_runs_in_place() -> None:
    assert run_compute(run_compute, _where) == run_compute(_where)


def test_background_work_sees_when_another_call_waits() -> None:
    from localchat.backends.compute_thread import compute_waiting

    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def background() -> None:
        started.set()
        release.wait(5)
        seen.append(compute_waiting())  # the other call below waits behind this one

    worker = threading.Thread(target=lambda: run_compute(background))
    worker.start()
    assert started.wait(5)
    assert not compute_waiting()  # running is not waiting
    other = threading.Thread(target=lambda: run_compute(lambda: None))
    other.start()
    deadline = time.monotonic() + 5
    while not compute_waiting():
        assert time.monotonic() < deadline, "the waiting call was never counted"
        time.sleep(0.001)
    release.set()
    worker.join(5)
    other.join(5)
    assert seen == [True] and not compute_waiting()
