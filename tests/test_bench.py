"""The bench's machinery (not its numbers): every part registered once and reachable from the
CLI, a fresh process's own memory peak, rounds that stop when they agree."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import localchat.bench
from localchat.bench import rss
from localchat.bench.common import settled, steady_best, steady_least
from localchat.bench.run import BENCHES, PARTS, TARGETS, format_report, judge
from localchat.cli.main import build_parser

BENCH_DIR = Path(localchat.bench.__file__).parent
# Modules of the bench package that are not parts: shared helpers and the registry.
HELPERS = {"__init__", "common", "rss", "run"}
MIB = 2**20


def test_every_part_module_is_registered_under_its_name_and_parts_come_from_the_registry() -> None:
    modules = {p.stem for p in BENCH_DIR.glob("*.py")} - HELPERS
    assert modules == set(BENCHES)
    assert tuple(BENCHES) == PARTS  # derived, in the registry's order: not a second list
    for part, function in BENCHES.items():
        module = importlib.import_module(f"localchat.bench.{part}")
        assert function is getattr(module, f"bench_{part}"), part
        assert function.__doc__, f"{part}: say what it measures"


def test_the_cli_help_names_every_part() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    bench = sub.choices["bench"]  # type: ignore[index]
    only = next(a for a in bench._actions if a.dest == "only")
    assert only.help is not None
    assert set(PARTS) <= set(re.findall(r"[a-z]+", only.help))


def test_targets_are_comparisons() -> None:
    assert all(op in (">=", "<=") for op, _ in TARGETS.values())
    assert {"memory_overhead_ratio", "memory_estimate_max_error"} <= set(TARGETS)


def test_a_drafting_speedup_out_of_the_machines_reach_is_not_judged() -> None:
    """Steps of k tokens that cost k single steps leave drafting nothing to gain: the speedup
    target is then reported with the bound, neither met nor missed; with room it is judged."""
    out_of_reach = judge({"spec_copy_speedup": 1.01, "spec_copy_possible": 1.13, "gen_ratio": 0.9})
    assert out_of_reach["spec_copy_speedup"]["met"] is None
    assert "at most x1.13" in out_of_reach["spec_copy_speedup"]["why"]
    assert out_of_reach["gen_ratio"]["met"] is False  # other targets as ever
    report = format_report({"targets": out_of_reach})
    assert "target spec_copy_speedup >= 1.15: 1.01 (not judged: drafting could give" in report
    in_reach = judge({"serve_spec_copy_speedup": 1.03, "serve_spec_copy_possible": 2.0})
    assert in_reach["serve_spec_copy_speedup"]["met"] is False
    assert judge({"spec_copy_speedup": 1.2})["spec_copy_speedup"]["met"] is True  # no bound
    met_anyway = judge({"spec_copy_speedup": 1.2, "spec_copy_possible": 1.13})
    assert met_anyway["spec_copy_speedup"]["met"] is True  # only a miss is excused


def test_an_unknown_part_fails_in_one_line(tmp_path: Path) -> None:
    localchat = Path(sys.executable).with_name("localchat")
    command = [str(localchat), "bench", "--only", "nosuch"] if localchat.exists() else [
        sys.executable, "-m", "localchat.cli.main", "bench", "--only", "nosuch",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unknown bench part nosuch" in lines[0] and "memory" in lines[0]


CHILD = """
import json, sys
from localchat.bench import rss
size = int(sys.argv[1])
start = rss._status_bytes("VmRSS")
block = b"\\x01" * size  # every page written: resident
del block
import resource
print(json.dumps({"start": start, "hwm": rss.high_water_bytes(), "peak": rss.peak_rss(),
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_a_fresh_process_reports_its_own_peak_not_its_parents() -> None:
    """The child allocates 128 MiB while this process holds 3x that: its VmHWM shows its own
    128 MiB above its start; ru_maxrss, carried over from this process, shows ours."""
    size = 128 * MIB
    held = b"\x02" * (3 * size)  # this process's peak, well above the child's
    parent_rss = rss._status_bytes("VmRSS")
    assert parent_rss is not None and parent_rss > 3 * size
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(size)], capture_output=True, text=True, check=True
    )
    del held
    child = json.loads(result.stdout)
    grew = child["hwm"] - child["start"]
    assert 0.9 * size <= grew <= size + 32 * MIB, grew / MIB
    assert child["hwm"] < parent_rss  # its own peak, not the one it was started from
    assert child["peak"] == [child["hwm"], "VmHWM"]
    # The defect this replaces: the kernel's ru_maxrss for the child is at least ours.
    assert child["ru_maxrss"] >= 3 * size


def test_the_peak_is_read_from_the_kernel_with_a_fallback() -> None:
    peak, source = rss.peak_rss()
    assert peak > 0 and source in ("VmHWM", "ru_maxrss")
    assert rss.high_water_bytes(999_999_999) is None  # no such process: no figure, no error


def test_rounds_stop_when_the_last_ones_agree() -> None:
    assert not settled([10.0], 0.05)
    assert settled([10.0, 10.4], 0.05)
    assert not settled([10.0, 11.0], 0.05)
    assert settled([8.0, 11.0, 10.9], 0.05)
    assert not settled([8.0, 11.0, 10.9], 0.05, last=3)
    assert settled([0.98, 0.99, 0.975], 0.03, last=3)


def test_each_side_counts_its_steady_best_round() -> None:
    """Bursts of a busy host only slow a round; a lone fast one (a moment of boost) is not
    repeated: a side's figure is its best that another round confirms, else its median."""
    assert steady_least([1.3, 1.0, 1.02]) == 1.0  # the slow burst does not count
    assert steady_least([0.5, 1.0, 1.02, 1.4]) == 1.0  # nor the lone fast one
    assert steady_least([1.0, 2.0, 3.0]) == 2.0  # no two agree: the median
    assert steady_best([40.0, 50.0, 49.5]) == pytest.approx(50.0)
