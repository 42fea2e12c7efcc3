"""The frame pacer: how often a streaming reply is redrawn, on clocks the test controls."""

from __future__ import annotations

from dataclasses import dataclass

from localchat.tui.pacing import FramePacer


@dataclass
class Clocks:
    wall: float = 100.0
    cpu: float = 5.0

    def pacer(self, threads: int = 2, share: float = 0.05, gap: float = 0.05) -> FramePacer:
        return FramePacer(
            threads, share, gap, wall_clock=lambda: self.wall, cpu_clock=lambda: self.cpu
        )


def test_chunks_that_arrive_together_make_one_frame() -> None:
    clocks = Clocks()
    pacer = clocks.pacer(share=1.0, gap=0.25)  # CPU is never the limit here
    clocks.wall += 0.25
    assert pacer.frame_due()
    clocks.wall += 0.125
    assert not pacer.frame_due()
    clocks.wall += 0.125
    assert pacer.frame_due()


def test_a_frame_waits_until_the_budget_covers_it() -> None:
    clocks = Clocks()
    pacer = clocks.pacer(threads=2, share=0.05)  # 0.1 CPU-s per second of generation
    clocks.wall += 0.1  # budget 0.01 s, nothing spent yet
    assert pacer.frame_due()
    clocks.cpu += 0.04  # that frame cost 40 ms
    clocks.wall += 0.1  # budget 0.02: spent 0.04 + the next frame's likely 0.04 > 0.02
    assert not pacer.frame_due()
    clocks.wall += 0.5  # budget 0.07: 0.04 + 0.04 > 0.07 still
    assert not pacer.frame_due()
    clocks.wall += 0.2  # budget 0.09 >= 0.08
    assert pacer.frame_due()


def test_the_app_stays_within_its_share_over_a_long_reply() -> None:
    """Every frame costs 30 ms; over 20 s the app draws no more than its share allows (plus
    at most one frame's overshoot), and still draws regularly."""
    clocks = Clocks()
    threads, share, frame_cost = 2, 0.03, 0.03
    pacer = clocks.pacer(threads=threads, share=share)
    frames = 0
    for _ in range(200):  # a chunk every 0.1 s
        clocks.wall += 0.1
        if pacer.frame_due():
            frames += 1
            clocks.cpu += frame_cost
    spent = pacer.ui_cpu_s()
    assert spent <= share * threads * 20.0 + frame_cost
    assert frames >= 0.8 * (share * threads * 20.0) / frame_cost


def test_nothing_is_drawn_mid_stream_with_no_share() -> None:
    clocks = Clocks()
    pacer = clocks.pacer(share=0.0)
    clocks.cpu += 0.001
    for _ in range(10):
        clocks.wall += 0.1
        assert not pacer.frame_due()


def test_idle_time_between_frames_is_not_taken_for_drawing() -> None:
    """The app's thread also does small things between frames (1 ms a chunk here); they use
    budget but do not make the next frame look more expensive, so frames keep coming."""
    clocks = Clocks()
    pacer = clocks.pacer(threads=2, share=0.05)  # 10 ms of budget per 0.1 s chunk
    frames = 0
    for _ in range(100):
        clocks.wall += 0.1
        clocks.cpu += 0.001
        if pacer.frame_due():
            frames += 1
            clocks.cpu += 0.006
    assert frames >= 90
